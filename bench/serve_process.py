"""``kestrel serve`` in a subprocess on a free loopback port, its stderr lines collected as they come: the bench's
server load test and the server's tests drive the same process."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.errors import BenchError

ROOT = Path(__file__).resolve().parent.parent


class ServeProcess:
    def __init__(self, model: Path | str, *flags: str, env: dict | None = None, timeout: float = 60, ranks: int = 1):
        """Start ``kestrel serve --model MODEL --port 0 FLAGS`` and wait until it has loaded (``timeout`` seconds);
        ``ranks`` > 1: under torchrun, its layers split over that many processes."""
        self.path = str(model)
        named = [f for i, f in enumerate(flags) if i and flags[i - 1] == "--served-model-name"]
        self.name = named[0].split(",")[0].strip() if named else Path(model).resolve().name  # the name answers carry
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)] \
            if ranks > 1 else [sys.executable]
        cmd = [*launch, "-m", "kestrel_core.cli", "serve", "--model", self.path, "--port", "0", *flags]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                     env={**os.environ, **(env or {})})
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.url = re.search(r"listening on (\S+)", self.wait_for("listening on", timeout)).group(1)
        self.wait_for("ready in", timeout)

    def client(self, key: str | None = None, timeout: float = 60):
        """The official ``openai`` client against this server (``key``: its API key, where it needs one)."""
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key or "unused", max_retries=0, timeout=timeout)

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, text: str, timeout: float = 60) -> str:
        """The first stderr line holding ``text``; a BenchError with every line so far where none comes, or the
        process ends first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = next((line for line in self.lines if text in line), None)
            if found is not None:
                return found
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.02)
        code = self.proc.poll()
        when = f"before it exited with code {code}" if code is not None else f"in {timeout:g} s"
        raise BenchError(f"no {text!r} from kestrel serve {when}; its stderr:\n" + "\n".join(self.lines))

    def stop(self, timeout: float = 60) -> None:
        """SIGTERM, and kill where it has not exited within ``timeout`` seconds."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
