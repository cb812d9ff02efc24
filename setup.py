"""megatron_kd: offline top-K knowledge distillation for Megatron-Core."""

from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent
version = {}
exec((ROOT / "megatron_kd" / "version.py").read_text(), version)

setup(
    name="megatron_kd",
    version=version["__version__"],
    description=(
        "Offline knowledge distillation for Megatron-Core: a Zarr cache of teacher top-K "
        "log-probabilities and a fused, chunked, vocab-parallel KL loss."
    ),
    long_description=(ROOT / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.12",
    packages=find_packages(include=["megatron_kd", "megatron_kd.*"]),
    install_requires=[
        "torch==2.11.0",
        "megatron-core>=0.19,<0.20",
        "zarr>=3",
        "numcodecs",
        # the cache's shard and teacher-weight checksums (CRC32C)
        "google-crc32c",
        # megatron-core's distributed checkpointing (async filesystem writer) imports it undeclared
        "psutil",
        "numpy",
        "tqdm",
        "matplotlib",
        "tensorboard",
        # Hugging Face weights in and out (GPT-OSS, Llama, Qwen3); modelopt imports requests without
        # declaring it. transformers 5's config API (rope_parameters); tested with 5.17 and 5.24
        "transformers>=5.17",
        "nvidia-modelopt==0.47.0",
        "requests",
    ],
    extras_require={
        # FlashAttention-4's CuTe kernels (Hopper / Blackwell): core attention's "flash4" path, which
        # "auto" takes where it is installed (models/attention.py); quack-kernels comes with it
        "flash4": ["flash-attn-4==4.0.0b36", "nvidia-cutlass-dsl[cu13]==4.8.1"],
        # pytest-xdist: the GPU test command runs its CUDA tests on several workers
        # megatron-kd gguf-to-hf: transformers reads GGUF files with gguf and loads them through accelerate
        "gguf": ["gguf>=0.17", "accelerate"],
        # megatron_kd.bridge: Megatron-Bridge recipes distilled from the cache (0.6.x: the training API it calls;
        # compat.SUPPORTED). Its import needs Transformer Engine (NGC's PyTorch image has it)
        "bridge": ["megatron-bridge>=0.6.2,<0.7"],
        "test": ["pytest>=8", "pytest-timeout", "pytest-xdist", "gguf>=0.17", "accelerate"],
        "dev": ["pytest>=8", "pytest-timeout", "pytest-xdist", "ruff", "gguf>=0.17", "accelerate"],
    },
    entry_points={"console_scripts": ["megatron-kd=megatron_kd.cli:main"]},
)
