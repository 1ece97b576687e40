import pytest


@pytest.fixture(scope="session")
def prefect_server():
    """One temporary Prefect server (a real one, on 127.0.0.1) for the in-process flow tests."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=60):
        yield
