"""The sample counts of a run, as Megatron-LM's training loop counts them, for the commands that
build the datasets without ``pretrain`` (cache build, prune) and for the cache a run needs:

1. a sample-based run (``--train-samples``, the Llama 3 and GPT-OSS recipes' form) without
   ``--train-iters`` or ``--eval-interval`` sizes its splits (no assertion, no TypeError)
2. a batch-size schedule consumes per iteration that iteration's global batch: the cache a teacher
   pass writes holds exactly what the student will read, not iterations x the final batch
3. ``--mock-data`` (the default branch of Megatron-LM's Llama 3 and GPT-OSS recipes) builds
   megatron-core's synthetic samples, as ``pretrain_gpt`` does
"""

from tests.fixtures.dist_utils import megatron_cpu_patches, spawn

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "1", "--tokenizer-type", "NullTokenizer",
         "--no-gradient-accumulation-fusion",
         "--vocab-size", "100", "--eval-iters", "2"]


def _sample_based_worker(rank, world_size):
    from megatron_kd.megatron.flags import parse_megatron_args
    from megatron_kd.megatron.run import consumed_train_samples, run_sizes

    with megatron_cpu_patches():
        args = parse_megatron_args([*MODEL, "--train-samples", "100", "--global-batch-size", "4"])
        assert args.train_iters is None and args.eval_interval == 101
        assert run_sizes(args) == [100, 8, 8]  # one evaluation (2 iterations x 4) at the end
        assert args.train_iters == 25
        assert consumed_train_samples(args) == 100


def test_a_sample_based_run_without_eval_interval_is_sized():
    spawn(_sample_based_worker, world_size=1)


def _schedule_worker(rank, world_size):
    from megatron_kd.megatron.flags import parse_megatron_args
    from megatron_kd.megatron.run import consumed_train_samples

    with megatron_cpu_patches():
        # thresholds in tokens (a run with --seq-length 32): batch 2 from 0, 4 from 4 samples, 6 from 8
        args = parse_megatron_args([*MODEL, "--train-iters", "10", "--step-batch-size-schedule", "0:2 128:4 256:6"])
        # batches 2 (0 consumed), 2 (2), 4 (4), then 6 from 8 consumed on: 2 + 2 + 4 + 7 x 6
        assert consumed_train_samples(args) == 50


def test_a_batch_size_schedule_is_counted_as_megatron_counts_it():
    spawn(_schedule_worker, world_size=1)


def _mock_data_worker(rank, world_size):
    from megatron_kd.megatron.flags import parse_megatron_args
    from megatron_kd.megatron.run import build_datasets, run_sizes

    with megatron_cpu_patches():
        args = parse_megatron_args([*MODEL, "--train-iters", "3", "--global-batch-size", "2", "--mock-data"])
        (train, valid, _), _ = build_datasets(run_sizes(args), is_built_on_rank=lambda *a, **k: True)
        assert type(train).__name__ == "MockGPTDataset" and len(train) >= 6
        assert train[0]["tokens"].shape == (32,)


def test_mock_data_builds_synthetic_samples():
    spawn(_mock_data_worker, world_size=1)
