"""DatasetError on its own, so the CLI can catch it without importing torch (megarl.data.dataset
does, through Batch) before the run has started its Ray cluster."""


class DatasetError(ValueError):
    """A dataset file or row does not match the canonical format."""
