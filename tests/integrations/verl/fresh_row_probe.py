"""Test helper, loaded by verl as a custom sampler: records what fresh rows look like in TransferQueue.

``trainer.v1.sampler.custom_sampler.{path,name}`` points verl's synchronous trainer at
:class:`FreshRowProbe`, verl's own ``ReplayBuffer`` plus one side effect: the first training
batch it hands out is read back from TransferQueue (every field of every row, before anything
of ours touches the batch) and described in a JSON file (``sampler_kwargs.row_probe_path``):
per field its kind (tensor / nested tensor / non-tensor), dtype, per-row shapes (non-tensor
fields: the type of each row's value and the first row's value, shortened), and for
``position_ids`` and ``input_ids`` the values themselves, so tests can check them against an
independent computation.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import transfer_queue as tq
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

VALUE_FIELDS = ("input_ids", "position_ids", "prompts", "responses")


def _describe(value: Any, rows: int) -> dict[str, Any]:
    if isinstance(value, torch.Tensor):
        nested = bool(value.is_nested)
        shapes = [list(value[i].shape) for i in range(rows)] if nested else [list(value.shape[1:])] * rows
        return {"kind": "nested_tensor" if nested else "tensor", "dtype": str(value.dtype), "row_shapes": shapes}
    items = value.tolist() if hasattr(value, "tolist") else list(value)
    return {
        "kind": "non_tensor",
        "type": type(value).__name__,
        "item_types": sorted({type(v).__name__ for v in items}),
        "first": repr(items[0])[:300],
    }


def describe_rows(data: Any) -> dict[str, Any]:
    rows = int(data.batch_size[0])
    fields = {name: _describe(data[name], rows) for name in sorted(data.keys())}
    values = {name: [data[name][i].tolist() for i in range(rows)] for name in VALUE_FIELDS if name in fields}
    return {"rows": rows, "fields": fields, "values": values}


class FreshRowProbe(ReplayBuffer):
    def sample(self, global_steps: int, partition_id: str, batch_size: int):
        batch, metrics = super().sample(global_steps=global_steps, partition_id=partition_id, batch_size=batch_size)
        path = self.sampler_kwargs.get("row_probe_path")
        if path and partition_id == "train" and not os.path.exists(path):
            data = tq.kv_batch_get(keys=list(batch.keys), partition_id=batch.partition_id)
            report = describe_rows(data)
            partial = f"{path}.partial"
            with open(partial, "w", encoding="utf-8") as handle:
                json.dump(report, handle)
            os.replace(partial, path)
        return batch, metrics
