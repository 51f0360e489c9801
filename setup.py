# Everything about the package is in pyproject.toml. This file only adds megarl.configs to the
# discovered packages: the run configs stay in configs/ (package-dir maps them), a folder outside
# megarl/ that find_packages cannot see.
from setuptools import find_packages, setup

setup(
    packages=[
        *find_packages(include=["megarl", "megarl.*", "checkpoint_convert", "checkpoint_convert.*"]),
        "megarl.configs",
    ]
)
