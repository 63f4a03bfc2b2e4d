"""Notebook 03c's ring-loop exercise (``03c.ring_loop``) and the library loop it is checked against.

The solution is the ``%%writefile`` cell of ``solutions/03c_long_sequences_and_experts.ipynb``;
each wrong loop below is that solution with one plausible mistake, and its diagnosis must name
the mistake (which block, which rank) without the code. The launch of the real ranks is
replaced by a recorder: ``tests/test_exercises_composing.py`` runs the rank side for real.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
import torch
import torch.nn.functional as F

from labkit.course import exercises as ex
from labkit.course.exercises import rank_checks
from labkit.course.exercises import sequences_experts as se
from labkit.parallel import context

NOTEBOOK = Path(__file__).resolve().parents[1] / "solutions" / "03c_long_sequences_and_experts.ipynb"


def _solution() -> str:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    (cell,) = [c.source for c in nb.cells
               if c.cell_type == "code" and c.source.startswith("%%writefile {ex_dir}/ring_loop.py")]  # fmt: skip
    return cell.split("\n", 1)[1] + "\n"


SOLUTION = _solution()


def _edit(old: str, new: str) -> str:
    assert old in SOLUTION, old  # the solution changed: update the mistake
    return SOLUTION.replace(old, new)


SKIP = "if not (causal and j > r):"
MASK = "mask=diagonal if causal and j == r else None"
MERGE = "out, lse = part if out is None else cp.merge(out, lse, *part)"
HOP = "            k, v = ring.pass_on(k, v)"
KEEP_ALL = (
    "import math\nimport torch\nfrom labkit.parallel import context as cp\n\n"
    "def ring_loop(q, k, v, ring, *, causal):\n"
    "    n, r, tl = ring.size, ring.rank, q.shape[-2]\n"
    "    parts = []\n"
    "    for s in range(n):\n"
    "        j = (r - s) % n\n"
    "        if not (causal and j > r):\n"
    "            mask = torch.ones(tl, tl, dtype=torch.bool).tril() if causal and j == r else None\n"
    "            parts.append(cp.block_attention(q, k, v, scale=1 / math.sqrt(q.shape[-1]), mask=mask))\n"
    "        if s < n - 1:\n"
    "            k, v = ring.pass_on(k, v)\n"
    "    out, lse = parts[-1]\n"
    "    for p in reversed(parts[:-1]):  # merged last block first\n"
    "        out, lse = cp.merge(out, lse, *p)\n"
    "    return out, lse\n"
)

# The mistake -> (the learner's file, words its diagnosis must contain).
WRONG_LOOPS = {
    "no causal skip": (_edit(SKIP, "if True:"),
                       "rank 2's output differs in rows it owns by [0-9.e+-]+: the block of rank 3, "
                       "which the causal mask hides entirely .* rank 2 must skip blocks from later ranks"),
    "a hidden block computed fully masked": (
        _edit(SKIP, "if True:").replace(
            MASK, "mask=(torch.arange(tl)[:, None] + r * tl >= torch.arange(tl) + j * tl) if causal else None"),
        r"did not skip: rank 2's output is correct but it computes 4 blocks where 3 suffice "
        r"\(and merges 3 times where 2 suffice\): the block of rank 3 was computed"),
    "blocks read as coming from rank + 1": (_edit("j = (r - s) % n", "j = (r + s) % n"),
                                            "as if they came round the other way"),
    "the received block dropped": (_edit(HOP, "            ring.pass_on(k, v)"),
                                   "rank 3 passed on its own block again"),
    "the loop stops at the first hidden block": (
        _edit(SKIP, "if causal and j > r:\n            break\n        if True:"),
        "rank 1 passed blocks on 2 times; in a ring of 4 every rank makes 3 hops"),
    "one hop too many": (_edit("if s < n - 1:", "if True:"), "passed blocks on 4 times where 3 hops"),
    "the running lse not updated": (
        _edit(MERGE, "if out is None:\n                out, lse = part\n            else:\n"
                     "                out, _ = cp.merge(out, lse, *part)"),
        "the running log-sum-exp was not updated"),
    "the diagonal block unmasked": (_edit(MASK, "mask=None"), "rank 3's own block .* attended in full"),
    "every block masked like the diagonal": (_edit(MASK, "mask=diagonal if causal else None"),
                                             "rank 3 attended the block of rank 2 with the diagonal"),
    "the earlier blocks skipped": (_edit("j > r", "j < r"), "rank 3 skipped the block of rank 2"),
    "the mask kept without causal": (_edit(SKIP, "if not j > r:").replace(MASK, "mask=diagonal if j == r else None"),
                                     "not causal: rank 3's output differs .* own block with the diagonal"),
    "a block merged with itself": (_edit("cp.merge(out, lse, *part)", "cp.merge(*part, *part)"),
                                   "a block merged twice"),
    "the scores unscaled": (_edit("1 / math.sqrt(q.shape[-1])", "1.0"), "scaled by 1; .* 1/√D"),
    "labkit's own loop called": (
        "from labkit.parallel import context as cp\n\ndef ring_loop(q, k, v, ring, *, causal):\n"
        "    return cp.ring_attention_blocks(q, k, v, ring, causal=causal)\n",
        "called labkit's own ring loop"),
    "every block held at once": (
        KEEP_ALL.replace("    parts = []\n    for s in range(n):\n",
                         "    held = [(k, v)]\n    for _ in range(n - 1):\n        k, v = ring.pass_on(k, v)\n"
                         "        held.append((k, v))\n    parts = []\n    for s, (k, v) in enumerate(held):\n")
        .replace("        if s < n - 1:\n            k, v = ring.pass_on(k, v)\n", ""),
        "rank 3 computed its own block after 3 hops, when it had already passed it on"),
    "merged out of order and scaled after": (
        KEEP_ALL.replace("    return out, lse\n", "    return out * 0.9, lse\n"),
        r"^a ring of 4 ranks, 3 positions each, causal: blocks merged in the wrong order changed "
        r"nothing \(merging is order-free\): the difference is elsewhere"),
    "merged without cp.merge": (_edit("cp.merge(out, lse, *part)", "((out + part[0]) / 2, torch.logaddexp(lse, part[1]))"),
                                "without cp.merge"),
    "the lse not returned": (_edit("return out, lse", "return out"), r"return \(out, lse\), two tensors"),
}  # fmt: skip

RIGHT_LOOPS = {
    "the solution": SOLUTION,
    "merge imported by name": _edit("from labkit.parallel import context as cp",
                                    "from labkit.parallel import context as cp\n"
                                    "from labkit.parallel.context import merge")
    .replace("cp.merge(", "merge("),
    "a state that starts empty": _edit("out = lse = None", "out = torch.zeros_like(q)\n"
                                       "    lse = torch.full(q.shape[:-1], float('-inf'))")
    .replace("part if out is None else cp.merge", "cp.merge"),
    "the parts merged in another order": KEEP_ALL,
}  # fmt: skip


@pytest.fixture
def launches(monkeypatch):
    calls: list[tuple[str, int]] = []

    def fake(exercise_id, objs, nproc=2):
        calls.append((exercise_id, nproc))
        return "(ranks not launched in this test)"

    monkeypatch.setattr(rank_checks, "run_in_workers", fake)
    return calls


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "ring_loop_try.py"
    path.write_text(text)
    return path


@pytest.mark.parametrize("name", sorted(RIGHT_LOOPS))
def test_a_right_loop_passes_and_goes_to_two_ranks(name, tmp_path, launches):
    said, _ = se.verify_file("03c.ring_loop", _write(tmp_path, RIGHT_LOOPS[name]))
    assert "equal SDPA over the whole sequence" in said
    assert launches == [("03c.ring_loop", 2)]


@pytest.mark.parametrize("mistake", sorted(WRONG_LOOPS))
def test_a_wrong_ring_loop_is_named_in_the_kernel(mistake, tmp_path, launches):
    source, says = WRONG_LOOPS[mistake]
    with pytest.raises(ex.ExerciseFailed) as info:
        se.verify_file("03c.ring_loop", _write(tmp_path, source))
    message = ex.without_failed_prefix("03c.ring_loop", str(info.value))
    assert re.search(says, message), message
    assert "k, v = ring.pass_on" not in message and "(r - s) % n" not in message  # no code
    assert launches == []


def test_the_check_restores_labkits_functions_and_the_learners_names(tmp_path, launches):
    before = (context.block_attention, context.merge, context.ring_attention_blocks, context.ring_local)
    path = _write(tmp_path, RIGHT_LOOPS["merge imported by name"])
    se.verify_file("03c.ring_loop", path)
    import sys

    assert sys.modules["ring_loop_try"].merge is context.merge
    assert (context.block_attention, context.merge, context.ring_attention_blocks,
            context.ring_local) == before  # fmt: skip


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_labkits_ring_loop_equals_sdpa_and_skips_the_hidden_blocks(n, causal, monkeypatch):
    """The exercise's reference: each rank's rows equal SDPA on the whole sequence, with
    n - 1 hops and, causal, r + 1 blocks computed on rank r."""
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(2, 3, 5 * n, 8, generator=g) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    scores = q @ k.transpose(-2, -1) / 8**0.5
    if causal:
        scores = scores.masked_fill(~torch.ones(5 * n, 5 * n, dtype=torch.bool).tril(), float("-inf"))
    shards = [list(t.chunk(n, dim=2)) for t in (q, k, v)]
    computed: list[int] = []
    attend = context.block_attention
    monkeypatch.setattr(context, "block_attention",
                        lambda *a, **kw: computed.append(1) or attend(*a, **kw))  # fmt: skip
    for r in range(n):
        computed.clear()
        ring = context.LocalRing(r, shards[1], shards[2])
        out, lse = context.ring_attention_blocks(shards[0][r], shards[1][r], shards[2][r], ring,
                                                 causal=causal)  # fmt: skip
        rows = slice(5 * r, 5 * (r + 1))
        torch.testing.assert_close(out, want[..., rows, :], atol=1e-5, rtol=0)
        torch.testing.assert_close(lse, torch.logsumexp(scores, -1)[..., rows], atol=1e-5, rtol=0)
        assert ring.hops == n - 1
        assert len(computed) == context.blocks_computed(r, n, causal=causal)


def test_the_ring_loops_last_hint_is_words_and_the_first_no_recipe():
    hints = ex.get("03c.ring_loop").hints
    assert hints[-1].startswith("recipe:") and "recipe" not in hints[0]
    assert not any(s in hints[-1] for s in ("pass_on", "(r", "% n", "=", "cp."))
