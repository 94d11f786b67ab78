"""``prepare_inputs`` with draft trees: tree nodes take consecutive slots after their root but depth-based RoPE
positions, the step's ``SpecTreeMask`` holds each tree request's ancestor rule, chain and plain requests are as
before, and the step message carries the parents to a worker's ``InputBatch``."""

from __future__ import annotations

import torch

from framework.core.outputs import SchedulerOutput
from framework.core.request import Request
from framework.core.sampling_params import SamplingParams
from framework.core.spec_tree import ancestor_mask
from framework.core.step_message import StepMessageBuilder
from framework.worker.input_batch import InputBatch, prepare_inputs

BS = 4


def _req(rid, n_prompt, computed):
    r = Request(request_id=rid, prompt_token_ids=list(range(10, 10 + n_prompt)),
                sampling_params=SamplingParams(temperature=0.0))
    r.num_computed_tokens = computed
    return r


def _step():
    tree, chain = _req("tree", 6, 5), _req("chain", 3, 2)  # both verify drafts after their last prompt token
    spec = {"tree": [40, 41, 42, 43], "chain": [50, 51]}
    parents = {"tree": [-1, -1, 0, 2]}
    counts = {"tree": 1 + 4, "chain": 1 + 2}
    return SchedulerOutput(scheduled_requests=[tree, chain], num_scheduled_tokens=counts,
                           total_num_scheduled_tokens=sum(counts.values()),
                           block_ids={"tree": ([7, 3, 9],), "chain": ([2, 5],)},
                           scheduled_spec_decode_tokens=spec, scheduled_spec_decode_parents=parents)


def test_tree_positions_slots_and_mask():
    batch = prepare_inputs(_step(), BS, torch.device("cpu"))
    assert [r.request_id for r in batch.requests] == ["tree", "chain"]
    assert batch.input_ids[0].tolist() == [15, 40, 41, 42, 43, 12, 50, 51]
    # tree: root at position 5, nodes at depths 1, 1, 2, 3; chain: consecutive
    assert batch.positions[0].tolist() == [5, 6, 6, 7, 8, 2, 3, 4]
    # slots stay consecutive: positions 5..9 of the tree through its table [7, 3, 9]
    assert batch.common.slot_mapping.tolist() == [3 * BS + 1, 3 * BS + 2, 3 * BS + 3, 9 * BS, 9 * BS + 1,
                                                  2 * BS + 2, 2 * BS + 3, 5 * BS]
    tree = batch.common.spec_tree
    assert tree.requests == [0] and torch.equal(tree.visible[0], torch.from_numpy(ancestor_mask([-1, -1, 0, 2])))
    assert batch.num_spec == [4, 2] and batch.logits_index.tolist() == list(range(8))
    assert tree.shifted(1) is None and tree.shifted(0).requests == [0]


def test_step_message_carries_parents_to_the_worker():
    so = _step()
    worker = InputBatch().apply(StepMessageBuilder().build(so))
    assert worker.scheduled_spec_decode_parents == {"tree": [-1, -1, 0, 2]}
    assert prepare_inputs(worker, BS, torch.device("cpu")).positions.tolist() == \
        prepare_inputs(so, BS, torch.device("cpu")).positions.tolist()
