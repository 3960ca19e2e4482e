"""Helpers shared by the PyTorch side of kiln's benchmarks."""

import socket


def free_port():
    """A TCP port on the loopback interface that nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
