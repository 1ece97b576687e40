import pytest


@pytest.fixture(scope="session")
def prefect_server():
    """One temporary Prefect server (a real one, on 127.0.0.1) for the in-process flow tests."""
    from prefect.logging.configuration import setup_logging
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=60):
        # Prefect configures logging (dictConfig, which replaces the root logger's handlers) on its first flow run;
        # done here, before any test's caplog attaches its handler, so caplog sees the records of the first test too
        setup_logging()
        yield
