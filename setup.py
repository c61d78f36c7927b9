from pathlib import Path

from setuptools import find_packages, setup

version = {}
exec((Path(__file__).parent / "co2_zero" / "version.py").read_text(), version)

setup(
    name="co2_zero",
    version=version["__version__"],
    description=(
        "CO2: local updates with fully overlapped asynchronous outer steps, "
        "sharded across ZeRO (DeepSpeed) and OSS (FairScale) partitions"
    ),
    long_description=Path("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["co2_zero", "co2_zero.*"]),
    python_requires=">=3.9",
    # An open torch range would pull a multi-GB CUDA build on a fresh machine: install torch first.
    install_requires=["torch>=2.1", "tqdm"],
    extras_require={
        "fairscale": ["fairscale==0.4.13"],
        "deepspeed": ["deepspeed==0.19.8"],
        # Hugging Face Trainer / Accelerate on CO2 reach it through DeepSpeed (co2_zero.hf)
        "hf": ["transformers>=5.23,<6", "accelerate>=1.15,<2", "deepspeed==0.19.8"],
        # elastic training: torchft's Lighthouse and Manager own the membership (co2_zero.elastic)
        "elastic": ["torchft==0.2.0"],
        "test": ["pytest>=7", "ruff"],
        "bench": ["matplotlib"],
    },
)
