"""TP/CP/PP peers of a data-parallel rank fetch a step once and share it (gloo, 2 processes)."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _peer(rank, store, mixture, cp_size, out):
    from dataloading.config import DataConfig
    from dataloading.construct.context_parallel import merge_cp_slices
    from dataloading.formats.tokenizer import ByteTokenizer
    from dataloading.serve.loader import build_loader
    from omni.runtime.data_feed import PeerFeed

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        def make():
            data = DataConfig(mixture=str(mixture), global_batch_size=4, micro_batch_tokens=1024, num_workers=0)
            return build_loader(data, ByteTokenizer(), {}, seed=1, dp_size=1, dp_rank=0, progress=False)
        feed = PeerFeed(make() if rank == 0 else None, None, src=0, cp_size=cp_size, cp_rank=rank,
                        pad_id=ByteTokenizer().eos_id)
        got = [next(feed) for _ in range(2)]
        state = feed.state_dict()
        mine = [[(mb.input_ids, mb.labels, mb.position_ids) for mb in b.micro_batches] for b in got]
        everyone = [None, None]
        dist.all_gather_object(everyone, (mine, state, [b.micro_batches for b in got]))
        if rank == 0:
            ref = make()
            full = [next(ref) for _ in range(2)]
            ok = everyone[0][1] == everyone[1][1] == ref.state_dict()
            for s, b in enumerate(full):
                for m, mb in enumerate(b.micro_batches):
                    if cp_size == 1:
                        for r in range(2):
                            ok &= all(torch.equal(x, y) for x, y in zip(everyone[r][0][s][m],
                                                                        (mb.input_ids, mb.labels, mb.position_ids)))
                    else:
                        merged = merge_cp_slices([everyone[r][2][s][m] for r in range(2)])
                        ok &= torch.equal(merged.input_ids, mb.input_ids) and torch.equal(merged.labels, mb.labels)
                        ok &= everyone[0][2][s][m].num_tokens == everyone[1][2][s][m].num_tokens
            out.put(bool(ok))
    finally:
        dist.destroy_process_group()


def test_peers_receive_the_source_ranks_steps(demo_dir, tmp_path, cp_size=2):
    mixture = tmp_path / "text.yaml"  # text only: the spawned peers need no media processors
    mixture.write_text(f"sources:\n  - {{name: text, path: {demo_dir / 'text'}, weight: 1}}\n")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    from tests.parallel.dist_helpers import rendezvous_file

    store = rendezvous_file()
    procs = [ctx.Process(target=_peer, args=(r, store, mixture, cp_size, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    assert out.get(timeout=5) is True


class _MediaLoader:
    """Steps of micro-batches with image and audio features (two dtypes), for the split path."""

    def __init__(self):
        self.step = 0

    def __next__(self):
        from dataloading.construct.batch import MediaInputs, MicroBatch, StepBatch

        self.step += 1
        gen = torch.Generator().manual_seed(self.step)
        mbs = []
        for i in range(2):
            ids = torch.randint(0, 50, (12,), generator=gen)
            media = {"image": MediaInputs(torch.randn(4 + i, 6, generator=gen), torch.tensor([[2, 2 + i // 2]]),
                                          torch.tensor([4]), torch.arange(4)),
                     "audio": MediaInputs(torch.randn(3, 5, generator=gen).double(), torch.tensor([[3]]),
                                          torch.tensor([2]), torch.arange(5, 7))}
            mbs.append(MicroBatch(ids, torch.arange(12), ids.clone(), torch.tensor([0, 12], dtype=torch.int32),
                                  media if i == 0 else {"image": media["image"]}, [f"s{self.step}.{i}"]))
        return StepBatch(self.step, mbs)

    def state_dict(self):
        return {"step": self.step, "problems": {}}


def _split_peer(rank, world):
    from omni.runtime.data_feed import PeerFeed

    feed = PeerFeed(_MediaLoader() if rank == 0 else None, None, src=0, features_on_device=True)
    got = [next(feed) for _ in range(2)]
    ref = _MediaLoader()
    for batch in got:
        want = next(ref)
        assert [mb.sample_ids for mb in batch.micro_batches] == [mb.sample_ids for mb in want.micro_batches]
        for a, b in zip(batch.micro_batches, want.micro_batches):
            assert torch.equal(a.input_ids, b.input_ids) and a.media.keys() == b.media.keys()
            for m in a.media:
                x, y = a.media[m], b.media[m]
                assert x.features.dtype == y.features.dtype and torch.equal(x.features, y.features)
                assert torch.equal(x.positions, y.positions) and torch.equal(x.sizes, y.sizes)
    assert feed.state_dict() == ref.state_dict()


def test_media_features_travel_apart_from_the_pickled_step():
    """The path NCCL peers take (features broadcast into the device, host objects pickled over
    gloo), forced on gloo: every rank gets the source's steps, features of both dtypes exact."""
    from tests.parallel.dist_helpers import run_ranks

    run_ranks(_split_peer, 2, timeout_s=120)
