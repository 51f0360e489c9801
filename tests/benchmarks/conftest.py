def pytest_configure(config):
    config.addinivalue_line(
        "markers", "benchmark_smoke: a benchmark script's --smoke run (tests/benchmarks; seconds to a minute each)"
    )
