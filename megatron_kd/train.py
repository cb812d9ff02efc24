"""``python -m megatron_kd.train``: the same entry point as ``megatron-kd train`` (see megatron/train.py)."""

from megatron_kd.megatron.train import main

if __name__ == "__main__":
    main()
