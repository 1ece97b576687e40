"""tasks.cluster: where the shard tasks go; a scheduler address is tried before anything runs."""
import socket

import pytest

from stages.harness.params_loader import load_params
from tasks.cluster import ClusterUnreachable, check_reachable, shard_runner
from tests.conftest import ROOT


def test_a_listening_address_passes_and_a_closed_one_names_key_and_address():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        check_reachable(f"tcp://127.0.0.1:{port}")
        check_reachable(f"127.0.0.1:{port}")  # distributed's default scheme
    with pytest.raises(ClusterUnreachable, match=rf"run\.dask_address = 'tcp://127\.0\.0\.1:{port}': no Dask "
                                                 r"scheduler answers there \(Connection refused\)"):
        check_reachable(f"tcp://127.0.0.1:{port}")


def test_no_address_keeps_the_flows_own_runner():
    with shard_runner(load_params(ROOT / "params.yaml")) as runner:
        assert runner is None
