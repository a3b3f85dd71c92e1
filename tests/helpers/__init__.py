"""Helpers shared by test modules, imported as ``from tests.helpers import ...``; the modules
beside this one group the rest: ``models`` (the tiny model, batches, one-process sharded
training), ``runs`` (TrainConfig runs, crashed and resumed), ``tensorboard`` (a run's event
files read back), ``k8s`` (the committed manifests, offline schemas, pod-spec accessors) and
``dying_encoder`` (imported by name in spawned worker processes)."""

import json
import os
import socket
from pathlib import Path

# Flags every test process gets unless XLA_FLAGS already names them (`make test-fast` adds an
# LLVM level there; `make test-numerics` other CPU kernels).
TEST_XLA_FLAGS = {"--xla_force_host_platform_device_count": "8"}


def xla_flags(**overrides: str) -> str:
    """XLA_FLAGS with the suite's defaults added where unset, and ``overrides`` (a flag's name
    without its dashes) replacing any value: for the processes a test starts."""
    flags = dict(flag.split("=", 1) if "=" in flag else (flag, "")
                 for flag in os.environ.get("XLA_FLAGS", "").split())
    for name, value in TEST_XLA_FLAGS.items():
        flags.setdefault(name, value)
    flags.update({f"--{name}": value for name, value in overrides.items()})
    return " ".join(f"{name}={value}" if value else name for name, value in flags.items())


PROMPT = "Once upon a time, there was a girl named Amy."


def free_port() -> int:
    """A TCP port on localhost that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_text(path: Path, text: str | bytes) -> Path:
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def write_jsonl(path: Path, *lines: object) -> Path:
    """Each line: a record (JSON-encoded) or a raw string written as is."""
    text = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n"
    path.write_text(text, encoding="utf-8")
    return path
