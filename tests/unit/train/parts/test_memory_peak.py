"""The bench's memory summary (pipeline.train.parts.memory_peak): the live blocks at the peak of an allocator
history, walked back from the blocks live at its end, grouped by who allocated them. A history in the format
torch.cuda.memory._snapshot() writes (segments with their blocks; the trace's alloc and free_completed events)."""

from __future__ import annotations

from pipeline.train.parts.memory_peak import GiB, peak_summary, site

STAGE3 = [{"filename": "/venv/deepspeed/runtime/zero/stage3.py", "line": 120, "name": "gather"}]
LOSS = [
    {"filename": "/venv/torch/nn/functional.py", "line": 10, "name": "linear"},
    {"filename": "/work/pipeline/train/step.py", "line": 77, "name": "lm_loss"},
]


def test_the_peak_is_found_by_walking_back_from_the_end_and_grouped_by_site() -> None:
    # live at the end: params (allocated before the recording: no frames) at 0 and a gathered buffer at 3 GiB
    snapshot = {
        "segments": [
            {
                "address": 0,
                "blocks": [
                    {"size": 2 * GiB, "state": "active_allocated", "frames": []},
                    {"size": GiB, "state": "inactive"},
                    {"size": GiB, "state": "active_allocated", "frames": STAGE3},
                ],
            }
        ],
        "device_traces": [
            [
                {"action": "alloc", "addr": 2 * GiB, "size": GiB, "frames": LOSS},  # the logits: the peak, 4 GiB
                {"action": "alloc", "addr": 3 * GiB, "size": GiB, "frames": STAGE3},
                {"action": "free_requested", "addr": 2 * GiB, "size": GiB, "frames": LOSS},
                {"action": "free_completed", "addr": 2 * GiB, "size": GiB, "frames": LOSS},
            ]
        ],
    }
    got = peak_summary(snapshot)
    assert got["peak_live_gib"] == 4 and got["events"] == 4
    assert [(s["site"], s["gib"]) for s in got["sites"]] == [
        ("before the recording began (no frames)", 2),
        ("deepspeed/runtime/zero/stage3.py:120 gather", 1),
        ("pipeline/train/step.py:77 lm_loss", 1),
    ]


def test_the_site_is_the_first_frame_that_says_who_allocated() -> None:
    assert site(LOSS) == "pipeline/train/step.py:77 lm_loss"
    assert site(LOSS[:1]) == "/venv/torch/nn/functional.py:10 linear"
