"""The sampling state in a checkpoint: buffered rollouts and generator states survive a round trip bit for bit,
per process; a checkpoint without the file reads as None."""
import torch

from stages.trainers.resume import flatten, load_state, save_state, state_file, unflatten


def test_round_trip_per_process(tmp_path):
    gen = torch.Generator().manual_seed(7)
    torch.rand(3, generator=gen)
    buffer = {0: {"input_ids": torch.tensor([[5, 6, 0]]), "truncated": torch.tensor([True]),
                  "old_logps": torch.tensor([[-0.25, -1.5, 0.0]])},
              1: {"input_ids": torch.tensor([[7, 8, 9]]), "truncated": torch.tensor([False]),
                  "old_logps": torch.tensor([[-0.5, -2.0, -3.0]])}}
    save_state(tmp_path, 1, {**flatten(buffer), "pair_rng": gen.get_state()})
    assert state_file(tmp_path, 1).exists() and load_state(tmp_path, 0) is None  # rank 0 wrote nothing here

    tensors = load_state(tmp_path, 1)
    got = unflatten(tensors)
    assert got.keys() == buffer.keys()
    for slot, batch in buffer.items():
        assert got[slot].keys() == batch.keys()
        assert all(torch.equal(got[slot][k], v) and got[slot][k].dtype == v.dtype for k, v in batch.items())
    restored = torch.Generator()
    restored.set_state(tensors["pair_rng"])
    assert torch.equal(torch.rand(4, generator=restored), torch.rand(4, generator=gen))


def test_nothing_buffered(tmp_path):
    save_state(tmp_path, 0, {})
    tensors = load_state(tmp_path, 0)
    assert tensors == {} and unflatten(tensors) == {}
