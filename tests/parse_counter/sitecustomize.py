"""Test-only (tests/test_parsed_once.py): count where a process reads the wire's messages.

Python imports `sitecustomize` at start-up from the path; this one waits for `workers.wire.protocol` and
`parallel.fields` to be imported and wraps `read_header` (every decode on every hop goes through it) and
`from_plain` (every typed read of a structure), appending "<process> <what> <job>" per call to the file named by
XDIT_PARSE_COUNTS.
"""

import functools
import importlib.abc
import importlib.util
import os
import sys

LOG = os.environ.get("XDIT_PARSE_COUNTS")
PROCESS = f"rank{os.environ['RANK']}" if "RANK" in os.environ else f"process{os.getpid()}"


def _note(what: str, job: str) -> None:
    with open(LOG, "a") as log:
        log.write(f"{PROCESS} {what} {job or '-'}\n")


def _wrap_protocol(module) -> None:
    read_header = module.read_header

    @functools.wraps(read_header)
    def counted(raw, kinds, *args, **kwargs):
        header = read_header(raw, kinds, *args, **kwargs)
        _note(f"header:{header.type}", header.job)
        return header

    module.read_header = counted


def _wrap_fields(module) -> None:
    from_plain = module.from_plain

    @functools.wraps(from_plain)
    def counted(cls, *args, **kwargs):
        if cls.__name__ in ("Submit", "SampleRequest"):
            _note(f"typed:{cls.__name__}", "")
        return from_plain(cls, *args, **kwargs)

    module.from_plain = counted


WRAPPERS = {"workers.wire.protocol": _wrap_protocol, "parallel.fields": _wrap_fields}


class _AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in WRAPPERS:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            WRAPPERS[name](module)

        spec.loader.exec_module = exec_module
        return spec


if LOG:
    sys.meta_path.insert(0, _AfterImport())
