"""attncheck.watch on a model called through a wrapper: DistributedDataParallel (one gloo process),
FSDP, a module that holds the watched one. Watched before the wrap, the model's calls are recorded
every step, named as the model names them, with the numbers the unwrapped model gives; a step
that runs no forward of the watched module warns once and is written to the log, and
`attncheck watch` reports it as no_attention."""

import json
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from typer.testing import CliRunner

import attncheck
from attncheck.cli import app
from attncheck.watcher import BLIND_FORWARDS

runner = CliRunner()


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = (z.view(2, 8, 4, 4).transpose(1, 2) for z in self.qkv(x).split(16, -1))
        return x + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 8, 16)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.fixture
def group(tmp_path):
    """A gloo process group of one rank (a file store: no port)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def train(wrap, steps=3, marked=False, log=None, watch_wrapper=False):
    """Net trained for ``steps`` through ``wrap(model)``, under a watch of the bare model (wrapped
    after the watch begins), or of the wrapper."""
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))
    runs = wrap(model) if watch_wrapper else None
    with attncheck.watch(runs if watch_wrapper else model, log=log) as w:
        runs = runs if watch_wrapper else wrap(model)
        opt = torch.optim.SGD(runs.parameters(), lr=0.1)
        for _ in range(steps):
            runs(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if marked:
                w.step()
    return w.records


def numbers(records):
    return [
        (
            r["step"],
            r["forwards"],
            [(c["module"], c["max_logit"], c["q_max"]) for c in r["calls"]],
            [g["module"] for g in r["grads"]],
        )
        for r in records
    ]


@pytest.mark.parametrize("marked", [False, True], ids=["forward-steps", "step-calls"])
def test_ddp_watched_before_the_wrap_records_every_call_as_the_bare_model_does(group, marked):
    bare = numbers(train(lambda m: m, marked=marked))
    ddp = numbers(train(lambda m: torch.nn.parallel.DistributedDataParallel(m), marked=marked))
    assert [(s, f, [c[0] for c in calls]) for s, f, calls, _ in ddp] == [
        (s, 1, ["layers.0", "layers.1"]) for s in (1, 2, 3)
    ]
    assert ddp == bare  # the same numbers: DDP over one rank trains as the bare model
    assert (
        numbers(train(lambda m: torch.nn.parallel.DistributedDataParallel(m), marked=marked, watch_wrapper=True))
        == bare
    )


@pytest.mark.parametrize("version", [1, 2])
def test_fsdp_inner_parts_are_left_out_of_the_names(group, version):
    """FSDP1 wraps each Block (``_fsdp_wrapped_module`` in every path); FSDP2's fully_shard shards in place."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    def wrap(m):
        if version == 1:
            return FSDP(
                m, device_id=torch.device("cpu"), auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True
            )
        for layer in m.layers:
            fully_shard(layer)
        return fully_shard(m)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP's own notices (CPU device, deprecations) are not the watch's
        records = train(wrap)
    assert [[c["module"] for c in r["calls"]] for r in records] == [["layers.0", "layers.1"]] * 3


def test_a_module_holding_the_watched_one_steps_per_forward_and_leaves_its_own_calls_out():
    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = Net()
            self.head = Block()

        def forward(self, x):
            return self.head(self.net(x))  # head's call comes after the watched module's forward: not recorded

    torch.manual_seed(0)
    outer, x = Outer(), torch.randn(2, 8, 16)
    with attncheck.watch(outer.net) as w:
        for _ in range(2):
            outer(x).sum().backward()
    assert [(r["step"], [c["module"] for c in r["calls"]]) for r in w.records] == [
        (1, ["layers.0", "layers.1"]),
        (2, ["layers.0", "layers.1"]),
    ]


def test_a_step_without_the_watched_module_warns_once_and_the_log_says_so(tmp_path):
    other, model, x = Net(), Net(), torch.randn(2, 8, 16)
    log = tmp_path / "w.jsonl"
    with pytest.warns(
        UserWarning, match=r"step 1 ended with no training forward of the watched module \(Net\)"
    ) as said:
        with attncheck.watch(other, log=log) as w:
            for _ in range(3):
                model(x).sum().backward()
                w.step()
    assert len([m for m in said if "attncheck.watch" in str(m.message)]) == 1
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r["step"], r["forwards"], r["calls"]) for r in records] == [(1, 0, []), (2, 0, []), (3, 0, [])]
    r = runner.invoke(app, ["watch", str(log), "--fail-on", "error"])
    assert r.exit_code == 1 and "error[no_attention]" in r.stdout and "no alert" not in r.stdout


def test_forwards_that_never_reach_the_watched_module_warn_during_the_run(tmp_path):
    other, model, x = Net(), Net(), torch.randn(2, 8, 16)
    with attncheck.watch(other) as w:
        for i in range(BLIND_FORWARDS + 2):
            if i < BLIND_FORWARDS - 1:  # a critic trained a few times before the watched model runs is no sign yet
                with warnings.catch_warnings():
                    warnings.simplefilter("error")
                    model(x).sum().backward()
            elif i == BLIND_FORWARDS - 1:
                with pytest.warns(
                    UserWarning,
                    match=f"{BLIND_FORWARDS} training forwards of other modules ran with no training forward",
                ):
                    model(x).sum().backward()
            else:
                model(x).sum().backward()  # said once
    assert [(r["forwards"], r["calls"]) for r in w.records] == [(0, [])]


def test_accelerates_prepared_model_is_watched_in_its_autocast_dtype():
    """accelerate's prepare (one process: the model with its forward run under bf16 autocast; under
    torchrun it wraps in DDP, followed as above): every call, in bf16, named as the model names them."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # a singleton: a Trainer test before may have set it up
    try:
        acc = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
        model = Net()
        with attncheck.watch(model) as w:
            runs, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
            for _ in range(2):
                acc.backward(runs(torch.randn(2, 8, 16)).float().pow(2).mean())
                opt.step()
                opt.zero_grad()
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert [(r["step"], [(c["module"], c["dtype"]) for c in r["calls"]]) for r in w.records] == [
        (s, [("layers.0", "bf16"), ("layers.1", "bf16")]) for s in (1, 2)
    ]


def test_wrapper_chains_and_the_names_they_leave():
    """What a wrapper holds, by the attributes DDP, torch.compile, FSDP and checkpointing use, and the
    call paths named as the innermost model names them."""
    from attncheck.wrappers import model_path, wrapped_modules

    net = Net()

    class Holder(torch.nn.Module):  # a model of its own whose child is named module: no wrapper
        def __init__(self, inner):
            super().__init__()
            self.module = inner

    class Compiled(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self._orig_mod = inner

    chain = wrapped_modules(torch.nn.DataParallel(Compiled(net)))  # DDP's module attribute, as DataParallel's
    assert [path for path, _ in chain] == ["", "module", "module._orig_mod"] and chain[-1][1] is net
    assert [path for path, _ in wrapped_modules(Holder(net))] == [""]
    assert [path for path, _ in wrapped_modules(net)] == [""]
    assert model_path("module._orig_mod.layers.0", "module._orig_mod", "Net") == "layers.0"
    assert model_path("module._orig_mod", "module._orig_mod", "Net") == "Net"
    assert model_path("layers.0._fsdp_wrapped_module.attn._checkpoint_wrapped_module", None, "Net") == "layers.0.attn"
    assert model_path("encoder.layers.1", "encoder", "Encoder") == "layers.1"
