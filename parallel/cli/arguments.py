"""An argparse parser whose mistakes end in one `error:` line that names the fix (no usage block)."""

from __future__ import annotations

import argparse
import sys


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        print(f"error: {message}; see {self.prog} --help", file=sys.stderr, flush=True)
        self.exit(2)
