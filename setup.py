from setuptools import find_packages, setup

setup(
    name="megarl",
    version="0.1.0",
    description="Megatron-native RL post-training for large MoE language models",
    packages=find_packages(include=["megarl", "megarl.*", "checkpoint_convert", "checkpoint_convert.*"]),
    package_data={"megarl": ["../configs/*.yaml"]},
    python_requires=">=3.11",
    # Exact pins live in requirements.lock and are installed by scripts/setup_env.sh;
    # torch / megatron-core need special install flags (see docs/engine.md, "Dependencies"), so they are not
    # listed here to keep `pip install -e .` from pulling CUDA wheels.
    install_requires=[],
    entry_points={"console_scripts": ["megarl=megarl.cli:entry"]},
)
