"""x0 previews and step events, in this process: the x0 of a flow-matching Euler step, the least-squares map, which
steps get previews, and the store path from a replica's output rank to a streamed request's events (the server
itself: test_serve.py)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers.configuration_utils import FrozenDict

from paradiff.plans.previews import PreviewLayout
from paradiff.runtime.previews import PreviewMaker, fit_linear_map, predicted_x0, x0_unavailable
from paradiff.runtime.progress import StepClock, StepEvent
from paradiff.serve.stream import ProgressRouter, StepPublisher, preview_steps


def test_x0_of_an_euler_flow_matching_step_is_the_clean_sample():
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler()
    scheduler.set_timesteps(6)
    generator = torch.Generator().manual_seed(0)
    clean, noise = torch.randn(2, 4, 8, generator=generator), torch.randn(2, 4, 8, generator=generator)
    sigma = float(scheduler.sigmas[0])
    latents = sigma * noise + (1 - sigma) * clean
    for step, timestep in enumerate(scheduler.timesteps):
        previous = latents
        latents = scheduler.step(noise - clean, timestep, latents).prev_sample  # the exact flow's velocity
        x0 = predicted_x0(previous, latents, float(scheduler.sigmas[step]), float(scheduler.sigmas[step + 1]))
        assert torch.allclose(x0, clean, atol=1e-4)
    assert x0_unavailable(scheduler) is None


def test_schedulers_without_a_derived_x0_are_named():
    from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler

    assert "DDIMScheduler is not a flow-matching Euler scheduler" in x0_unavailable(DDIMScheduler())
    assert "samples stochastically" in x0_unavailable(FlowMatchEulerDiscreteScheduler(stochastic_sampling=True))


@pytest.mark.parametrize("steps, count, expected", [(4, 2, [2, 3]), (8, 2, [3, 6]), (8, 3, [3, 5, 6]),
                                                    (2, 2, []), (28, 1, [15]), (8, 0, [])])
def test_previews_are_spread_over_the_steps_that_have_an_x0(steps, count, expected):
    assert preview_steps(steps, count) == expected


class LinearDecoder(torch.nn.Module):
    """A VAE stand-in whose decode is a 1x1 convolution scaled up 4x: a linear map fits it exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = torch.nn.Conv2d(4, 3, 1)
        with torch.no_grad():
            self.mix.weight.copy_(torch.randn(3, 4, 1, 1, generator=torch.Generator().manual_seed(1)) * 0.1)
            self.mix.bias.copy_(torch.tensor([0.1, -0.2, 0.0]))
        self.config = FrozenDict(latent_channels=4)

    def decode(self, latents, return_dict=False):
        return (torch.nn.functional.interpolate(self.mix(latents), scale_factor=4),)


LAYOUT = PreviewLayout(cell=lambda pipeline: 4, grid=lambda latents, rows, columns: latents,
                       decoder_input=lambda grid, vae: grid)


def test_the_fitted_map_recovers_a_linear_decoder_and_is_cached(tmp_path):
    pipeline = SimpleNamespace(vae=LinearDecoder(), transformer=None)
    fitted = fit_linear_map(pipeline, LAYOUT, tmp_path)
    expected = pipeline.vae.mix.weight.detach().view(3, 4) / 2  # [-1, 1] decoded to [0, 1]
    assert torch.allclose(fitted.weight, expected, atol=1e-4) and fitted.fit_error < 1e-4
    assert len(list(tmp_path.glob("linear-*.json"))) == 1
    assert torch.equal(fit_linear_map(pipeline, LAYOUT, tmp_path).weight, fitted.weight)  # read back


def test_a_step_publisher_hands_previews_to_rank_0_before_the_round_ends_and_leaves_no_key():
    """The output rank's publisher puts progress and PNG previews in the store; rank 0's router hands each preview
    on once, in order, and the round's end leaves the store as it was."""
    import io

    import torch.distributed as dist
    from PIL import Image

    from paradiff.serve.ranks import Channel

    store = dist.HashStore()
    channel = Channel(store, 0, 1)
    empty = store.num_keys()
    scheduler = SimpleNamespace(sigmas=torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]), step_index=0)
    pipeline = SimpleNamespace(vae=LinearDecoder(), transformer=None, scheduler=scheduler)
    maker = PreviewMaker(pipeline, LAYOUT, "linear", fit_linear_map(pipeline, LAYOUT))
    publisher = StepPublisher(channel, 0, maker)
    steps, previews = [], []
    router = ProgressRouter(lambda replica, progress: steps.append(progress["step"]),
                            lambda item, index, png: previews.append((item, index, png)))
    context = {"round": 1, "ids": [7], "steps": 4, "height": 16, "width": 16,
               "items": [{"id": 7, "partial_images": 2}]}
    clock = StepClock()
    clock.begin()
    for step in range(1, 5):
        scheduler.step_index = step
        publisher(StepEvent(step, 4, clock.tick(), torch.randn(1, 4, 4, 4), context))
        router.poll(channel, 1)
    router.finish_round(channel, 1)
    assert steps == [1, 2, 3, 4] and len(clock.times) == 4
    assert [(item, index) for item, index, _ in previews] == [(7, 0), (7, 1)]
    assert all(np.asarray(Image.open(io.BytesIO(png))).shape == (16, 16, 3) for _, _, png in previews)
    assert store.num_keys() == empty


def test_a_video_jobs_progress_and_its_requests_events_are_the_same_step_events(tmp_path):
    """One record per replica and step (the output rank's StepPublisher) is all rank 0 reads: a real Frontend hands it
    to the running request as its "step" event (what a stream's answer reads), and the video job's progress in the
    job store follows the same events, step for step; /metrics' rate comes from them; no other key is written."""
    import torch.distributed as dist

    from paradiff.api.load_spec import LoadSpec
    from paradiff.serve.app import Frontend
    from paradiff.serve.ranks import Channel
    from paradiff.serve.settings import ServeSettings

    frontend = Frontend(ServeSettings(LoadSpec("wan"), out=str(tmp_path), frames=5, steps=4))
    try:
        frontend.replica_ready(0, {"kind": "video", "accepts": ["num_frames", "callback_on_step_end"], "adapters": [],
                                   "replicas": 1}, [{"rank": 0, "memory": 0}], 0)
        video = frontend.jobs.create({"prompt": "a fox", "size": "32x32"}, frontend.limits, max_queue=4)
        (item,) = frontend.scheduler.next_round([0], 0)["batches"][0]
        frontend.started([item])
        request = frontend.scheduler.running(item["id"])
        steps_seen, progress_seen = [], []
        request.add_listener(lambda event: steps_seen.append((event["done"], event["total"])))
        store = dist.HashStore()
        channel = Channel(store, 0, 1, scope="r0")
        publisher = StepPublisher(channel, 0, None)
        context = {"round": 1, "ids": [item["id"]], "steps": 4, "height": 32, "width": 32,
                   "items": [{"id": item["id"], "partial_images": 0}], "progress": {item["id"]: [0, 4]}}
        for step in range(1, 5):
            publisher(StepEvent(step, 4, 0.01, None, context))
            assert store.num_keys() == 1  # the replica's one step record: no key per job
            frontend.progress.poll(channel, [0])
            progress_seen.append(frontend.jobs.known(video["id"])["progress"])
        assert steps_seen == [(1, 4), (2, 4), (3, 4), (4, 4)]
        assert progress_seen == [100 * done // total for done, total in steps_seen[:3]] + [99]  # 100 once completed
        assert 'paradiff_replica_steps_per_second{replica="0"} 100.0' in frontend.render_metrics()
    finally:
        frontend.stop()


def test_a_jobs_listener_gets_its_events_in_order_those_before_it_too():
    from paradiff.serve.protocol import ImageRequest
    from paradiff.serve.scheduler import Job

    job = Job(1, ImageRequest("x", 1, 64, 64, 0, 4, None, None), 0.0, 10.0)
    job.emit({"type": "step", "step": 1})
    seen = []
    job.add_listener(seen.append)
    job.emit({"type": "step", "step": 2})
    job.finish(200, {})
    job.emit({"type": "step", "step": 3})  # after the answer: dropped
    assert [event["step"] for event in seen] == [1, 2]
