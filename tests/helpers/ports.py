"""A free loopback TCP port, for gloo rendezvous (MASTER_PORT, init_method) and torchrun's --master_port."""

import socket


def free_port() -> int:
    """A port the OS just handed out on 127.0.0.1 (closed again: a race with another process is possible but
    rare, and a spawn that loses it fails loudly at rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
