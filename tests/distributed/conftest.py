"""What the distributed tests share: the tiny model (hidden 32, 1 layer) and a free rendezvous port."""
import socket

import pytest

from stages.builtin import tiny


@pytest.fixture(scope="session")
def model(tmp_path_factory) -> str:
    return str(tiny.build(tmp_path_factory.mktemp("tiny"), hidden_size=32, num_layers=1, num_heads=2,
                          intermediate_size=64, vocab_size=384, seed=0))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
