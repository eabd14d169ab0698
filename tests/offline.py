"""Run a command with the network cut, where this machine allows it: the test suite must need none.

    python tests/offline.py python -m pytest ...     # what `make test` runs

As root (CI) the command runs in a network namespace of its own where only loopback exists and is up:
the tests' servers on 127.0.0.1 work, anything else fails at once. Elsewhere (no root, or a container
without the right to make a namespace) it runs as it is, after one line saying the network is not cut.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import sys

SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


def loopback_up() -> None:
    """Bring ``lo`` up (a new network namespace has it down), as ``ip link set lo up`` does."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack("16sH14x", b"lo", 0)))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


def cut_network() -> bool:
    """Move this process into a new network namespace with loopback only; False where not allowed."""
    try:
        os.unshare(os.CLONE_NEWNET)
    except (PermissionError, AttributeError, OSError):
        return False
    loopback_up()
    return True


def main() -> None:
    if not cut_network():
        print("offline.py: the network is NOT cut (needs root and unshare): the command runs with it", flush=True)
    os.execvp(sys.argv[1], sys.argv[1:])


if __name__ == "__main__":
    main()
