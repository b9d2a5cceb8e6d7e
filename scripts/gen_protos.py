"""Generate the compactor's Python gRPC code from ``protos/`` (or check it is current).

    python scripts/gen_protos.py          # regenerate compactor_service/v1/*_pb2*.py
    python scripts/gen_protos.py --check  # exit 1 if the committed code drifted

Uses the pinned ``grpcio-tools`` (see pyproject's ``[dev]`` extra); the generated code
is committed so that installing the package needs no code generator.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(root: Path, out_dir: Path) -> list[Path]:
    """Run protoc (from grpcio-tools) on ``root/protos`` into ``out_dir``; return the
    generated files."""
    from grpc_tools import protoc

    proto_root = root / "protos"
    protos = sorted(p.relative_to(proto_root).as_posix() for p in proto_root.rglob("*.proto"))
    args = [
        "protoc",
        f"-I{proto_root}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed: {' '.join(args)}")
    return sorted(p for p in out_dir.rglob("*") if p.name.endswith(GENERATED_SUFFIXES))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if committed code drifted")
    parser.add_argument("--root", type=Path, default=ROOT, help="repository root")
    args = parser.parse_args(argv)
    root = args.root
    if not args.check:
        generated = generate(root, root)
        print("\n".join(str(p.relative_to(root)) for p in generated))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(root, Path(tmp))
        drifted = []
        for path in fresh:
            committed = root / path.relative_to(tmp)
            if not committed.exists() or not filecmp.cmp(path, committed, shallow=False):
                drifted.append(str(committed.relative_to(root)))
        if drifted:
            print(
                "generated gRPC code is out of date with protos/: "
                + ", ".join(drifted)
                + "\nrun: python scripts/gen_protos.py",
                file=sys.stderr,
            )
            return 1
    print(f"generated gRPC code matches protos/ ({len(fresh)} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
