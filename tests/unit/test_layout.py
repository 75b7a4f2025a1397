"""derive_layout: the run layout from the config and the world size, before any process group exists."""
import pytest

from training.config import ConfigError, config_from_dict
from training.layout import derive_layout


def _cfg(tp=1, pp=1, mb=4, gb=32, vocab=None, divisible=128):
    return config_from_dict({"model": {"vocab_size": vocab, "make_vocab_size_divisible_by": divisible},
                             "parallel": {"tensor": tp, "pipeline": pp},
                             "train": {"micro_batch_size": mb, "global_batch_size": gb}})


def test_layout_of_a_tp2_pp2_run_on_16_ranks():
    # 16 ranks / (TP 2 x PP 2) = DP 4; 512 / (8 x 4) = 16 micro-batches per rank; GPT-2's 50257 tokens
    # padded to a multiple of 128 x 2 = 256: 197 x 256 = 50432
    lay = derive_layout(_cfg(tp=2, pp=2, mb=8, gb=512, vocab=50257), 16)
    assert (lay.dp, lay.grad_accumulation, lay.padded_vocab) == (4, 16, 50432)
    assert lay.micro_batches_per_step == 64 and (lay.tp, lay.pp, lay.world_size) == (2, 2, 16)


def test_layout_vocabulary_from_the_tokenizer_and_unknown():
    # BERT's 30522 tokens at TP 1: 239 x 128 = 30592; without any vocabulary size the padding is unknown
    assert derive_layout(_cfg(), 1, vocab_size=30522).padded_vocab == 30592
    assert derive_layout(_cfg(), 1).padded_vocab is None
    # one process, whole batch in 8 micro-batches; an exact multiple stays as it is (TP 4: 512 | 1024)
    lay = derive_layout(_cfg(tp=4, mb=1, gb=8, vocab=1024), 4)
    assert (lay.dp, lay.grad_accumulation, lay.padded_vocab) == (1, 8, 1024)


def test_layout_refusals():
    with pytest.raises(ConfigError, match="world size 6 is not divisible by TP x PP = 4 x 1"):
        derive_layout(_cfg(tp=4), 6)
    with pytest.raises(ConfigError, match="global_batch_size=32 is not divisible by micro_batch_size x DP = 4 x 3"):
        derive_layout(_cfg(), 3)


def test_sample_order_positions_by_hand():
    from training.data.sample_order import micro_batch_positions

    # step starting at sample 16, global 16, micro 2, DP 4 -> 2 micro-batches per rank; rank 1 reads
    # 16 + 0*8 + 1*2 = [18, 20) and 16 + 1*8 + 2 = [26, 28)
    assert [list(r) for r in micro_batch_positions(16, 2, 4, 1, 16)] == [[18, 19], [26, 27]]
    # DP 2 and DP 1 with twice the accumulation read the same samples in one step
    dp2 = sorted(p for rank in (0, 1) for r in micro_batch_positions(8, 2, 2, rank, 8) for p in r)
    assert dp2 == sorted(p for r in micro_batch_positions(8, 2, 1, 0, 8) for p in r) == list(range(8, 16))


def test_one_process_for_a_model_parallel_run_names_the_launcher():
    """Without the launcher (one process) a TP/PP run says what is missing: the launcher command, with the
    process count, the module and (for the run config) the keys that make it fit one process."""
    from training.layout import data_parallel_size

    with pytest.raises(ConfigError, match=r"TP x PP = 2 x 1 needs 2 processes and this is one: run under the "
                                          r"launcher, `deepspeed --num_gpus 2 --module \S+ \.\.\.` .*parallel.tensor=1"):
        data_parallel_size(1, 2)
    with pytest.raises(ConfigError, match=r"--tp 2 x --pp 2 needs 4 processes .*--num_gpus 4"):
        data_parallel_size(1, 2, 2, flags=True)
    assert data_parallel_size(1, 1) == 1 and data_parallel_size(4, 2) == 2
