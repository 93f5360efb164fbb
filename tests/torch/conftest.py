def pytest_configure(config):
    config.addinivalue_line(
        "markers", "full: longer cases, run with RINGZERO_TORCH_SUITE=full (tests/torch/run.sh)"
    )
