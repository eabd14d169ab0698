"""An SSH server on 127.0.0.1 standing in for the TPU VM (asyncssh, in a background thread).

Like a VM's sshd it runs each command as `bash -c COMMAND` (no command: an interactive `bash`)
in its own home directory, with a small environment of its own: nothing of the test process's
environment (HF_TOKEN in particular) leaks into it. It accepts only the keys `authorized()`
returns, as `user:ssh-ed25519 AAAA...` lines (the format of the instance's `ssh-keys` metadata),
so a test can make the fake Compute API's metadata the only source of access. Closing the
connection kills the command's process group, as sshd's SIGHUP does; `drop_sessions()` aborts every
live connection, the way a VM that is preempted or deleted takes its sessions with it. `hold(text)`
keeps each command containing `text` from starting until `release()` (or until its client goes
away): its client then waits in the middle of a session, where a test can interrupt it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import asyncssh


class _Server(asyncssh.SSHServer):
    def __init__(self, authorized: Callable[[], list[str]],
                 live: set[asyncssh.SSHServerConnection]) -> None:
        self.authorized = authorized
        self.live = live
        self.conn: asyncssh.SSHServerConnection | None = None

    def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
        self.conn = conn
        self.live.add(conn)

    def connection_lost(self, exc: Exception | None) -> None:
        self.live.discard(self.conn)

    def begin_auth(self, username: str) -> bool:
        return True

    def public_key_auth_supported(self) -> bool:
        return True

    def validate_public_key(self, username: str, key: asyncssh.SSHKey) -> bool:
        mine = key.export_public_key().decode().split()[:2]
        for line in self.authorized():
            user, _, public = line.partition(":")
            if user == username and public.split()[:2] == mine:
                return True
        return False


class LoopbackSshd:
    """Start with `start()`, read `port`, `commands` (every command run), stop with `stop()`."""

    def __init__(self, home: Path, authorized: Callable[[], list[str]],
                 env: dict[str, str] | None = None) -> None:
        self.home = home
        self.authorized = authorized
        self.env = {"HOME": str(home), "PATH": "/usr/local/bin:/usr/bin:/bin",
                    "LANG": "C.UTF-8", **(env or {})}
        self.commands: list[str | None] = []
        self.held: list[str] = []          # the held commands that have arrived
        self._hold: str | None = None
        self._released = asyncio.Event()   # bound to the server's loop when first awaited
        self.port = 0
        self.host_key = asyncssh.generate_private_key("ssh-ed25519")
        self._live: set[asyncssh.SSHServerConnection] = set()
        self._children: set[int] = set()   # pids of the commands running now
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncssh.SSHAcceptor | None = None

    def start(self) -> LoopbackSshd:
        self.home.mkdir(parents=True, exist_ok=True)
        self._thread.start()

        async def listen() -> asyncssh.SSHAcceptor:
            return await asyncssh.create_server(
                lambda: _Server(self.authorized, self._live), "127.0.0.1", 0,
                server_host_keys=[self.host_key],
                process_factory=self._handle, encoding=None)

        self._server = asyncio.run_coroutine_threadsafe(listen(), self._loop).result(10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def hold(self, text: str) -> None:
        """Commands containing ``text`` wait before they start, until :meth:`release`."""
        self._loop.call_soon_threadsafe(self._released.clear)
        self._hold = text

    def release(self) -> None:
        self._hold = None
        self._loop.call_soon_threadsafe(self._released.set)

    def drop_sessions(self) -> int:
        """Abort every live connection; return how many there were, once their commands are dead."""

        async def abort() -> int:
            conns = list(self._live)
            for conn in conns:
                conn.abort()
            while self._children:
                await asyncio.sleep(0.02)
            return len(conns)

        return asyncio.run_coroutine_threadsafe(abort(), self._loop).result(10)

    def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _handle(self, process: asyncssh.SSHServerProcess) -> None:
        self.commands.append(process.command)
        if self._hold and self._hold in (process.command or ""):
            self.held.append(process.command)
            gone = asyncio.ensure_future(process.channel.wait_closed())
            released = asyncio.ensure_future(self._released.wait())
            await asyncio.wait({gone, released}, return_when=asyncio.FIRST_COMPLETED)
            released.cancel()
            if gone.done():
                return
            gone.cancel()
        argv = ["bash", "-c", process.command] if process.command else ["bash"]
        child = await asyncio.create_subprocess_exec(
            *argv, cwd=self.home, env=self.env, start_new_session=True,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
        self._children.add(child.pid)

        async def feed() -> None:
            assert child.stdin is not None
            try:
                while data := await process.stdin.read(65536):
                    child.stdin.write(data)
                    await child.stdin.drain()
            except (BrokenPipeError, ConnectionResetError, asyncssh.Error):
                pass
            finally:
                child.stdin.close()

        async def drain(src: asyncio.StreamReader, dst: asyncssh.SSHWriter) -> None:
            while data := await src.read(65536):
                dst.write(data)

        async def run() -> int:
            assert child.stdout is not None and child.stderr is not None
            await asyncio.gather(drain(child.stdout, process.stdout),
                                 drain(child.stderr, process.stderr))
            return await child.wait()

        feeder = asyncio.ensure_future(feed())
        runner = asyncio.ensure_future(run())
        closed = asyncio.ensure_future(process.channel.wait_closed())
        try:
            await asyncio.wait({runner, closed}, return_when=asyncio.FIRST_COMPLETED)
            feeder.cancel()
            if runner.done() and not runner.exception():
                process.exit(runner.result())
            else:  # the client went away: hang up on the command like sshd does
                runner.cancel()
                try:
                    os.killpg(child.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                await child.wait()
            closed.cancel()
        finally:
            self._children.discard(child.pid)
