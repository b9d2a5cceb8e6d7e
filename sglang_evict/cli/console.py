"""The ``sglang-evict`` console script.

``compactor-health`` is an exec probe run every few seconds: it is dispatched before
anything imports torch (``compactor_service.health`` imports gRPC only). Every other
command goes to ``sglang_evict.cli.main``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["compactor-health"]:
        from compactor_service.health import main as health_main

        return health_main(argv[1:])
    from sglang_evict.cli.main import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
