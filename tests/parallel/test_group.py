"""omnistage.parallel.group: ranks spawn, join one gloo group, get step commands, and an ended rank is
seen; Ray ranks without Ray name the extra; the tensor-parallel step message's block-table diffs."""

import pytest
import torch
import torch.distributed as dist

from omnistage.parallel import group


def _echo(init, rank, reply_q):
    group.init_rank(init, rank)
    chan = group.StepChannel()
    got = chan.recv()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    reply_q.put((rank, got, float(t[0])))
    group.destroy()


def test_spawn_channel_allreduce():
    import multiprocessing as mp

    init = group.ParallelInit.for_device("cpu", 2)
    assert (init.backend, init.device_type) == ("gloo", "cpu")
    q = mp.get_context("spawn").Queue()
    workers = group.spawn_ranks(init, _echo, (q,))
    try:
        group.init_rank(init, 0)
        assert (group.world_size(), group.rank(), group.is_parallel()) == (2, 0, True)
        cmd = {"ids": [1, 2, 3], "positions": [[0, 1], [2]]}
        group.StepChannel().send(cmd)
        t = torch.tensor([1.0])
        dist.all_reduce(t)
        assert float(t[0]) == 3.0
        assert q.get(timeout=120) == (1, cmd, 3.0)
        group.destroy()
        workers.procs[0].join(120)          # rank 1 ends by itself: seen as dead, with its exit code
        assert not workers.alive() and workers.dead_ranks() == [1] and workers.exit_codes() == {1: 0}
    finally:
        group.destroy()
        workers.close(timeout=60)
    assert group.world_size() == 1 and not group.is_parallel()


def test_bad_sizes_name_the_option():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not divide num_attention_heads=4.*\[1, 2, 4\]"):
        group.check_divides("tensor_parallel_size", 3, num_attention_heads=4)
    group.check_divides("tensor_parallel_size", 2, num_attention_heads=4, vocab_size=64)
    if torch.cuda.device_count() < 64:
        with pytest.raises(ValueError, match="tensor_parallel_size=64 needs 64 CUDA devices"):
            group.check_world_fits_devices(64)
    with pytest.raises(ValueError, match="backend"):
        group.ParallelInit(2, "mpi", "tcp://127.0.0.1:1", "cpu")


def test_block_table_diffs_rebuild_the_tables():
    """What crosses per step: only new blocks; a re-allocated table goes whole; dropped ones are forgotten."""
    from omnistage.ar.step_inputs import StepInputs
    from omnistage.ar.tensor_parallel import BlockTables

    def step(tables: dict) -> StepInputs:
        return StepInputs([0] * len(tables), [0] * len(tables), [0] * len(tables), len(tables), list(tables),
                          [list(t) for t in tables.values()], [1] * len(tables), [], 4, [])

    sender, receiver = BlockTables(), BlockTables()
    seen = []
    for tables in ({"a": [3], "b": [5, 6]}, {"a": [3], "b": [5, 6, 7]}, {"a": [9, 2]}, {"b": [5, 6, 7, 8]}):
        msg = sender.diff(step(tables))
        seen.append(msg.tables)
        assert receiver.apply(msg).block_tables == list(tables.values())
        if "a" in tables and tables["a"] == [9, 2]:
            sender.drop("a")
    assert seen[1] == {"b": (2, [7])} and seen[2] == {"a": (0, [9, 2])} and seen[3] == {"b": (3, [8])}
    assert "a" not in receiver.held


def test_ray_ranks_without_ray_name_the_extra(monkeypatch):
    """distributed_executor_backend ray with tensor_parallel_size 2: the ranks' launcher needs Ray."""
    import sys

    from omnistage.config import EngineConfig

    monkeypatch.setitem(sys.modules, "ray", None)   # `import ray` fails as when it is not installed
    config = EngineConfig(device="cpu", tensor_parallel_size=2, distributed_executor_backend="ray")
    with pytest.raises(RuntimeError, match=r"pip install 'omnistage\[ray\]'"):
        group.ParallelInit.for_engine(config, 2)
    init = group.ParallelInit.for_engine(EngineConfig(device="cpu"), 2)
    assert init.ray_address is None and init.init_method.startswith("tcp://127.0.0.1:")
