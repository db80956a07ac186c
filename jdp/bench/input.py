"""How fast jdp's train input pipeline delivers ImageNet-style examples, with threads
and with 1, 2, ... worker processes, against what an accelerator consumes.

    python -m jdp.bench input                    # 2,000 synthetic JPEGs, cached
    python -m jdp.bench input --model=resnet50 --device="TPU v5p" --mfu=0.5

The source is generated once into --data_dir: JPEGs of about 500x375 pixels with
varied content (JPEG decoding time depends on it), in an ArrayRecord file as jdp's
own files are written. Each measurement runs the real `streamed.train_batches`
with the imagenet2012 training preprocessing (decode, random-resized crop to
224, flip; uint8 out) after a warm-up that starts every worker.
"""

from __future__ import annotations

import io
import math
import os
import tempfile
import time

import numpy as np

from jdp.data import files, images, streamed
from jdp.observe import throughput

# Forward FLOPs of one 224x224 example, 2 FLOPs per multiply-add (as jdp's MFU counts).
# ViT: jdp.models.vit's formula; ResNet-50: its 4.1 G multiply-adds.
MODELS = {"vit_b16": "ViT-B/16", "vit_s16": "ViT-S/16", "resnet50": "ResNet-50"}
_RESNET50_FORWARD_FLOPS = 2 * 4.1e9
_IMAGE_SIZE = (375, 500)  # height, width: about ImageNet's typical photo
_JPEG_QUALITY = 90


def add_arguments(parser, name: str) -> None:
    parser.add_argument("--data_dir", default=os.path.join(tempfile.gettempdir(),
                                                           "jdp-bench-input"),
                        help="where the synthetic source is written once and reused")
    parser.add_argument("--num_images", type=int, default=2000)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--examples", type=int, default=640,
                        help="examples timed per measurement, after the warm-up")
    parser.add_argument("--repeats", type=int, default=3,
                        help="measurements per worker count, interleaved; the best counts "
                        "(other load on the machine only ever slows one down)")
    parser.add_argument("--num_threads", type=int, default=4,
                        help="threads of the 0-worker measurement (config.data.num_threads)")
    parser.add_argument("--max_workers", type=int, default=os.cpu_count(),
                        help="measure 1, 2, 4, ... worker processes up to this many")
    parser.add_argument("--model", choices=sorted(MODELS), default="vit_b16")
    parser.add_argument("--model_flops_per_example", type=float, default=None,
                        help="forward FLOPs of one example, instead of --model's")
    known = ", ".join(throughput.known_device_kinds())
    parser.add_argument("--device", default="NVIDIA H100",
                        help=f"a device kind with a known peak FLOP/s: {known}")
    parser.add_argument("--mfu", type=float, default=0.4,
                        help="the model FLOP utilisation the accelerator reaches")


def run(args) -> None:
    path = synthetic_source(args.data_dir, args.num_images)
    source = files.ArrayRecordSource([path])
    preprocess = images.make_preprocess(images.PRESETS["imagenet2012"].image, train=True,
                                        augment=True)
    counts = [0, *worker_counts(args.max_workers)]
    samples = {n: [] for n in counts}
    for _ in range(args.repeats):  # interleaved, so a neighbour's load hits all alike
        for num_workers in counts:
            samples[num_workers].append(examples_per_s(
                source, preprocess, args.batch_size, args.examples, num_workers,
                args.num_threads))
    rates = {n: max(values) for n, values in samples.items()}
    for num_workers, rate in rates.items():
        how = f" ({args.num_threads} threads of this process)" if num_workers == 0 else ""
        print(f"workers={num_workers}{how}: {rate:.1f} examples/s, best of "
              f"{', '.join(f'{v:.0f}' for v in samples[num_workers])} "
              f"(batch {args.batch_size}, {os.cpu_count()} CPU cores)")
    print(consumption(args, per_core=rates[1]))
    most = max(rates)
    print(f"input: {most} workers / 1 worker examples/s = {rates[most] / rates[1]:.2f}")


def worker_counts(max_workers: int) -> list[int]:
    """1, 2, 4, ... and max_workers itself."""
    return sorted({*(2**k for k in range(max_workers.bit_length()) if 2**k <= max_workers),
                   max(1, max_workers)})


def _forward_flops(args) -> float:
    if args.model_flops_per_example:
        return args.model_flops_per_example
    if args.model == "resnet50":
        return _RESNET50_FORWARD_FLOPS
    from jdp.models.vit import flops_per_example, vit

    model = vit({"vit_b16": "base", "vit_s16": "small"}[args.model], num_classes=1000,
                patch_size=16, pool="cls")
    return flops_per_example(model, image_size=224, channels=3) / 3


def consumption(args, per_core: float) -> str:
    """What the accelerator consumes at --mfu, and the cores that takes at `per_core`."""
    peak = throughput.peak_flops_per_s(args.device)
    if peak is None:
        raise SystemExit(f"--device={args.device!r}: no known peak FLOP/s. Fix: use one of "
                         f"{', '.join(throughput.known_device_kinds())}.")
    forward = _forward_flops(args)
    consumed = peak * args.mfu / (3 * forward)
    name = "the model" if args.model_flops_per_example else MODELS[args.model]
    return (f"{name} ({forward / 1e9:.1f} GFLOPs forward, x3 to train) on {args.device} "
            f"({peak / 1e12:.0f} TFLOP/s peak) at {100 * args.mfu:.0f}% MFU consumes "
            f"{consumed:.0f} examples/s = {consumed / per_core:.1f} cores at the measured "
            f"{per_core:.1f} examples/s per worker")


def examples_per_s(source, preprocess, batch_size: int, examples: int, num_workers: int,
                   num_threads: int) -> float:
    """Examples/s the train pipeline delivers once every worker has started.

    P threads or workers prepare P batches at a time, which finish close together:
    the warm-up and the timed window are whole multiples of P batches, so the window
    neither starts with finished batches nor ends in the middle of a round.
    """
    producers = num_workers or num_threads
    warmup = 2 * producers  # every worker has delivered twice
    timed = producers * max(3, math.ceil(examples / batch_size / producers))
    stream = streamed.example_stream(source, preprocess, seed=0)
    batches = streamed.train_batches(stream, global_batch_size=batch_size,
                                     rows=slice(0, batch_size), start_step=0,
                                     num_steps=warmup + timed, num_threads=num_threads,
                                     num_workers=num_workers)
    try:
        for _ in range(warmup):
            next(batches)
        start = time.perf_counter()
        for _ in range(timed):
            batch = next(batches)
        seconds = time.perf_counter() - start
    finally:
        batches.close()
    assert batch["image"].shape == (batch_size, 224, 224, 3) and batch["image"].dtype == np.uint8
    return timed * batch_size / seconds


def synthetic_source(data_dir: str, num_images: int) -> str:
    """The ArrayRecord file of `num_images` synthetic JPEGs, written on first use."""
    path = os.path.join(data_dir, f"synthetic-jpeg-{num_images}.array_record")
    if os.path.exists(path):
        print(f"reusing {num_images} synthetic JPEGs in {path}")
        return path
    os.makedirs(data_dir, exist_ok=True)
    start = time.perf_counter()
    partial = f"{path}.partial-{os.getpid()}"
    sizes = []

    def examples():
        for index in range(num_images):
            jpeg = synthetic_jpeg(np.random.default_rng(index))
            sizes.append(len(jpeg))
            yield {"image": np.frombuffer(jpeg, np.uint8), "label": np.int32(index % 1000)}

    files.write_array_records(partial, examples())
    os.replace(partial, path)  # a killed run leaves no half-written source behind
    print(f"wrote {num_images} synthetic JPEGs (mean {np.mean(sizes) / 1024:.0f} KiB) to "
          f"{path} in {time.perf_counter() - start:.0f} s")
    return path


def synthetic_jpeg(rng: np.random.Generator) -> bytes:
    """A photo-like JPEG of about 500x375: smooth colour fields, edges and texture, so that
    it compresses (and decodes) like a photograph rather than like a flat colour."""
    from PIL import Image, ImageDraw

    height, width = _IMAGE_SIZE
    if rng.random() < 0.25:  # some portraits, as in ImageNet
        height, width = width, height
    scale = rng.uniform(0.8, 1.2)
    height, width = round(height * scale), round(width * scale)
    coarse = rng.integers(0, 256, (6, 8, 3), np.uint8)
    image = Image.fromarray(coarse).resize((width, height), Image.BICUBIC)
    draw = ImageDraw.Draw(image)
    for _ in range(rng.integers(3, 12)):  # objects with sharp edges
        x0, x1 = sorted(rng.integers(0, width, 2))
        y0, y1 = sorted(rng.integers(0, height, 2))
        fill = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x0, y0, x1, y1), fill=fill)
    pixels = np.asarray(image, np.float32) + rng.normal(0, 12, (height, width, 3))
    buffer = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(
        buffer, format="JPEG", quality=_JPEG_QUALITY)
    return buffer.getvalue()
