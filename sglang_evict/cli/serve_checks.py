"""Checks ``sglang-evict serve`` and ``calibrate`` make before they start work: the
model folder's config.json, the sidecar's paths, an output file. Each refusal is a
``ValueError`` whose one line names the flag or file and the fix (the CLI prints it and
exits 2); nothing here creates or leaves anything behind."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def model_path_of(sglang_argv: list[str]) -> str | None:
    """``--model-path`` (or SGLang's alias ``--model``) among SGLang's arguments; None
    when absent (SGLang's parser says so) or given only through ``--config``."""
    model_path = None
    for i, flag in enumerate(sglang_argv):
        if flag in ("--model-path", "--model") and i + 1 < len(sglang_argv):
            model_path = sglang_argv[i + 1]
        elif flag.startswith(("--model-path=", "--model=")):
            model_path = flag.split("=", 1)[1]
    return model_path


def check_model_config(sglang_argv: list[str]) -> None:
    """A local model folder's config.json, read before SGLang reads it: SGLang (through
    transformers) reports a file that is not JSON as an ``OSError`` and one that is not
    an object as a traceback; here either is one line naming the file."""
    from sglang_evict.calibrate import read_config_json

    model_path = model_path_of(sglang_argv)
    if model_path is not None and (Path(model_path) / "config.json").exists():
        read_config_json(Path(model_path))


def unwritable(directory) -> str | None:
    """Why files cannot be created in ``directory``, or None when they can (a missing
    one counts as usable when it can be created, parents included, as its user will).
    Nothing is left behind: an existing directory is checked with ``os.access``; for a
    missing one, the nearest existing ancestor is tried with a directory made and removed
    at once (``os.access`` says yes to root even where nothing can be created, as in
    /proc)."""
    directory = os.path.abspath(directory)
    if os.path.isdir(directory):
        if not os.access(directory, os.W_OK | os.X_OK):
            return f"{directory} is not writable"
        return None
    ancestor = directory
    while not os.path.lexists(ancestor):
        ancestor = os.path.dirname(ancestor)
    try:
        if not stat.S_ISDIR(os.stat(ancestor).st_mode):
            return f"{ancestor} is not a directory"
        os.rmdir(tempfile.mkdtemp(dir=ancestor))
    except OSError as error:
        return f"cannot create {directory} ({error.strerror} in {ancestor})"
    return None


def check_compactor_paths(config, device: str | None, dry_run: bool) -> None:
    """The sidecar's paths as the scheduler will use them (``--kv-compactor grpc``):

    * ``--kv-compactor-pool-dir``: where a CPU KV pool is shared with the compactor
      (CUDA pools go by IPC handle, no file). The scheduler creates it at startup and
      fails there if it cannot, so an unusable one is refused now.
    * ``--kv-compactor-socket`` (dry run only): the scheduler only connects to it. A
      server may start before its compactor (passes complete in-process until the
      socket appears), so a real start takes any path; a dry run, which validates a
      deployment, refuses a socket whose directory does not exist: the compactor creates
      it when it starts, so either the compactor is not started or the path is wrong.
      The default socket is exempt: its directory is the compactor's default runtime
      directory, which only the compactor creates, at the same path."""
    from compactor_service.runtime_dir import DEFAULT_SOCKET, ensure_private_dir

    if config.compactor != "grpc":
        return
    if not str(device or "").startswith("cuda"):
        flag = "--kv-compactor-pool-dir"
        pool_dir = Path(config.shm_dir)
        if pool_dir.is_dir():
            ensure_private_dir(pool_dir, flag)  # exists: checked, never created here
        problem = unwritable(pool_dir)
        if problem:
            raise ValueError(
                f"{flag} {config.shm_dir}: {problem}; the scheduler shares its CPU KV pool "
                f"with the compactor through files there: choose a directory you can write"
            )
    if not dry_run or config.compactor_address is not None:
        return
    flag, path = "--kv-compactor-socket", config.compactor_socket
    socket_dir = Path(path).absolute().parent
    if not socket_dir.exists():
        if Path(path).absolute() == Path(DEFAULT_SOCKET):
            return
        raise ValueError(
            f"{flag} {path}: directory {socket_dir} does not exist, so the scheduler cannot "
            f"reach a compactor there; start the compactor first (`sglang-evict compactor "
            f"--socket {path}` creates it) or fix the path (only the default socket's "
            f"directory may be missing at a dry run)"
        )
    if not socket_dir.is_dir():
        raise ValueError(f"{flag} {path}: {socket_dir} is not a directory; fix the path")
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return  # no socket yet: the compactor is not started
    if not stat.S_ISSOCK(mode):
        raise ValueError(
            f"{flag} {path} exists and is not a socket (the compactor refuses it too); "
            f"remove it or choose another path"
        )


def check_output_file(out: Path, flag: str = "--out") -> None:
    """Refuse (``ValueError`` naming ``flag``) an output file that cannot be written,
    before any computation: a calibration can take hours, and its result would be lost."""
    if out.is_dir():
        raise ValueError(f"{flag} {out}: cannot write it (a directory); name a stats file")
    if out.exists():
        problem = None if os.access(out, os.W_OK) else f"{out} is not writable"
    else:
        problem = unwritable(out.parent)
    if problem:
        raise ValueError(f"{flag} {out}: cannot write it ({problem}); choose another path")
