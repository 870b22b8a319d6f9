"""The command line: the parser, and every check of what a user can get wrong, made before any process starts."""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
from pathlib import Path

from paradiff.cli.common import (DTYPES, CliError, _positive, flag_error, lora_specs,  # noqa: F401 - public here
                                 quantize_skip)
from paradiff.cli.conditioning import call_parameter_names, check_conditioning
from paradiff.cli.plan import add_plan_parser

DEBUG_HELP = ("show Python tracebacks, native (C++) stack traces and libraries' warnings on failures, as "
              "PARADIFF_DEBUG=1 does")
SEED_MAX = 2**63 - 1  # as serve's seed field: torch's generators take 64-bit seeds


class Parser(argparse.ArgumentParser):
    """argparse's parser with one-line errors: `paradiff generate: error: --steps: expected a positive integer, got
    -3; see paradiff generate --help` and exit 2, instead of the whole usage before the one useful line. Its
    sub-commands' parsers are of this class too, and show each option's default in --help."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        message = message.removeprefix("argument ")  # "argument --steps: ..." -> "--steps: ..."
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" to an option's help, unless the help already says its default or there is none to say
    (None, or False for a switch)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or action.default is False or action.default == argparse.SUPPRESS \
                or "default" in text.lower():
            return text
        return super()._get_help_string(action)


def _seconds(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds above 0, got {value!r}") from None
    if not 0 < number < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds above 0 (and finite), got {value}")
    return number


def _finite(value: str) -> float:
    """A number a pipeline call takes (a guidance scale, a strength): finite (nan and inf draw garbage or nothing)."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from None
    if not math.isfinite(number):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {value}")
    return number


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """What `generate` and `serve` share: the model, the mesh, how it is loaded and the generation defaults."""
    gen = parser
    gen.add_argument("model", nargs="?", default=None,
                     help="pipeline folder or Hub id; omitted: the embedded tiny FLUX.2 pipeline, trained to draw "
                          "captioned shapes (64x64)")
    gen.add_argument("--negative-prompt", default=None,
                     help="what to steer away from (pipelines whose __call__ takes negative_prompt; true CFG)")
    gen.add_argument("--tp", type=_positive, default=1,
                     help="tensor-parallel degree: each transformer layer's weights split over this many ranks")
    gen.add_argument("--ulysses", type=_positive, default=1,
                     help="Ulysses context-parallel degree: the tokens split, attention heads exchanged (all-to-all)")
    gen.add_argument("--ring", type=_positive, default=1,
                     help="ring-attention context-parallel degree: the tokens split, keys/values passed around a ring")
    gen.add_argument("--cfg", type=_positive, default=1,
                     help="CFG-parallel degree: 2 runs the conditional and unconditional branches on different ranks")
    gen.add_argument("--dp", type=_positive, default=1,
                     help="data-parallel replicas: the prompts are shared out among this many copies of the mesh")
    gen.add_argument("--fsdp", type=_positive, default=1,
                     help="shard the transformers' block weights over N ranks (FSDP2, docs/fsdp.md): with --ulysses / "
                          "--ring it must equal their product and adds no rank; without them it adds N ranks")
    gen.add_argument("--fsdp-offload", action="store_true",
                     help="with --fsdp: keep each rank's shards in CPU memory, copied to the device one block ahead "
                          "of use (FSDP2's CPU offload; docs/fsdp.md)")
    gen.add_argument("--parallel", choices=("auto",), default=None,
                     help="'auto': take the degrees `paradiff plan` recommends for this model, size and --world "
                          "(docs/plan.md)")
    gen.add_argument("--world", type=_positive, default=None,
                     help="with --parallel auto: how many ranks (default: torchrun's WORLD_SIZE)")
    gen.add_argument("--profile", default="h100-sxm",
                     help="with --parallel auto: the hardware profile to plan with (a built-in name or a file)")
    gen.add_argument("--steps", type=_positive, default=None,
                     help="denoising steps (default 4, the embedded pipeline's too)")
    gen.add_argument("--height", type=_positive, default=64, help="image height in pixels (a multiple of 16)")
    gen.add_argument("--width", type=_positive, default=64, help="image width in pixels (a multiple of 16)")
    gen.add_argument("--frames", type=_positive, default=None,
                     help="frames per video (video pipelines only; default: the pipeline's own)")
    gen.add_argument("--fps", type=_positive, default=16, help="frame rate of the MP4 files")
    gen.add_argument("--guidance-scale", type=_finite, default=None,
                     help="guidance_scale= of the pipeline call (default: the pipeline's own)")
    gen.add_argument("--true-cfg-scale", type=_finite, default=None,
                     help="true_cfg_scale= of the pipeline call, where it takes one (default: the pipeline's own)")
    gen.add_argument("--dtype", choices=DTYPES, default="float32", help="the dtype weights are loaded and run in")
    gen.add_argument("--timeout", type=_seconds, default=600.0, help="collective timeout in seconds")
    gen.add_argument("--plan", default=None,
                     help="transformer TP plan: 'auto' (derived from its structure) or FILE.py; default built-in")
    gen.add_argument("--cp-plan", default=None, help="transformer CP plan: 'auto' or FILE.py; default built-in")
    gen.add_argument("--no-parallel-vae", action="store_true",
                     help="decode the whole image on each rank instead of splitting the VAE's rows across the ranks")
    gen.add_argument("--stages", action="store_true",
                     help="staged execution: only the current stage's components hold weights (text encoders, then "
                          "the transformer, then the VAE); a replica's prompts run as one batch")
    gen.add_argument("--quantize", choices=("int8", "fp8", "nf4"), default=None,
                     help="quantize the transformer's weights on read, each rank its own shards: int8 / fp8 weight-only "
                          "(torchao, per-row scales) or nf4 (bitsandbytes); docs/quantization.md")
    gen.add_argument("--quantize-skip", default=None, metavar="MODULE[,MODULE]",
                     help="with --quantize: the transformer's modules left unquantized, by name (llm_int8_skip_modules "
                          "/ modules_to_not_convert), e.g. context_embedder; docs/quantization.md")
    gen.add_argument("--quantize-text-encoders", action="store_true",
                     help="with --quantize: quantize the text encoders paradiff loads too (transformers' rule: the LM "
                          "head stays in --dtype), split like the rest")
    gen.add_argument("--gguf", action="append", default=None, metavar="[COMPONENT=]FILE",
                     help="read the transformer's weights from a GGUF file (e.g. a Q4_K_M file of city96's) instead "
                          "of the model folder, each rank only its shards, held packed; COMPONENT= names another "
                          "transformer (transformer_2 of Wan 2.2); repeatable; docs/quantization.md")
    gen.add_argument("--whole-text-encoders", action="store_true",
                     help="keep the text encoders whole on every rank instead of splitting them over the mesh")
    gen.add_argument("--compile", action="store_true",
                     help="torch.compile the transformer's blocks (paradiff.compile), in every parallel mode")
    gen.add_argument("--compile-backend", default=None, help="torch.compile backend for --compile (default inductor)")
    gen.add_argument("--attention-backend", default=None, metavar="NAME",
                     help="the kernel the transformers' attention runs on, with or without context parallelism: "
                          "native, math, sdpa, sdpa-flash, sdpa-efficient, sdpa-cudnn, flex, flash "
                          "(paradiff.set_attention_backend; docs/context-parallel.md)")
    gen.add_argument("--lora", action="append", default=None, metavar="PATH[:SCALE]",
                     help="a LoRA adapter for the transformer (a file, folder or Hub id, any format diffusers' "
                          "load_lora_weights reads) at SCALE (default 1); repeatable: the adapters are mixed")
    gen.add_argument("--lora-weight-name", default=None,
                     help="which file of a --lora folder or Hub repo holding several")
    gen.add_argument("--cache", default=None, metavar="SPEC",
                     help="step cache, decisions agreed by all ranks: 'fbc:THRESHOLD' (first-block cache, e.g. "
                          "fbc:0.08) or 'taylorseer:INTERVAL[:WARMUP]' (e.g. taylorseer:3:2)")


def _port(value: str) -> int:
    number = _positive(value)
    if number > 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port from 1 to 65535, got {number}")
    return number


def build_parser() -> argparse.ArgumentParser:
    from paradiff import __version__

    parser = Parser(prog="paradiff", description="Parallel diffusion inference with diffusers models.")
    parser.add_argument("--version", action="version", version=f"paradiff {__version__}")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate images (PNG) or videos (MP4 + a PNG per frame) and a JSON "
                                               "run report")
    add_model_options(gen)
    gen.add_argument("--prompt", action="append", default=None,
                     help="a prompt (repeatable); default: the embedded pipeline's demo prompts")
    gen.add_argument("--prompts-file", default=None,
                     help="a text file with one prompt per line; a line 'ADAPTER<TAB>PROMPT' draws that prompt with "
                          "one --lora adapter only (its file name without .safetensors, or loraN; '-' for none), "
                          "prompts with different adapters in one call (docs/lora.md, adapters per sample)")
    gen.add_argument("--batch", type=_positive, default=4,
                     help="with an adapter column in --prompts-file: prompts per pipeline call (default 4)")
    gen.add_argument("--seed", type=int, default=0, help="random seed of the first prompt; prompt i uses seed + i")
    gen.add_argument("--dry-run", action="store_true",
                     help="print each rank's memory for this mesh (weights held, FSDP gathers, activations) from the "
                          "transformers' configs, without reading a weight or starting a rank; docs/fsdp.md")
    gen.add_argument("--device-memory", type=_finite, default=None, metavar="GB",
                     help="with --dry-run: say whether a device of GB holds it, and which flag to add if not")
    gen.add_argument("--out", default="out", help="output folder (PNG/MP4 files and report.json)")
    gen.add_argument("--also-without-lora", action="store_true",
                     help="with --lora: draw every prompt twice on the one loaded pipeline, with the adapters "
                          "switched off (NNNN-without-lora.png) and on (NNNN.png), same seed; --compare checks both")
    gen.add_argument("--compare", action="store_true",
                     help="also run the single-process pipeline for rank 0's outputs, print the max difference and "
                          "write compare.png (single process | parallel | |difference| amplified; a row per image, "
                          "the first, middle and last frames of a video)")
    cond = gen.add_argument_group("conditioning inputs", "passed to the pipeline call where its __call__ takes them "
                                  "(docs/cli.md); --pipeline picks another class for the same folder")
    cond.add_argument("--image", action="append", default=None, metavar="PATH",
                      help="image= of the call: an init / reference / first-frame image; repeatable (a list: "
                           "multi-reference editing)")
    cond.add_argument("--mask", default=None, metavar="PATH", help="mask_image= (inpainting; white is repainted), "
                                                                   "as large as the first --image")
    cond.add_argument("--control-image", default=None, metavar="PATH", help="control_image= (ControlNet, Control)")
    cond.add_argument("--video", default=None, metavar="PATH", help="video= (video-to-video), read with PyAV")
    cond.add_argument("--last-image", default=None, metavar="PATH",
                      help="last_image= (first-last-frame video: Wan 2.1 FLF2V, SkyReels-V2 I2V; --image is the first)")
    cond.add_argument("--reference-image", action="append", default=None, metavar="PATH",
                      help="reference_images= (Wan VACE), repeatable")
    cond.add_argument("--strength", type=_finite, default=None, help="strength= (img2img / inpaint), 0 to 1")
    cond.add_argument("--controlnet-scale", type=float, default=None, metavar="FLOAT",
                      help="controlnet_conditioning_scale= (ControlNet pipelines: how strongly its residuals are added)")
    cond.add_argument("--pipeline", default=None, metavar="CLASS",
                      help="run this diffusers pipeline class on the model folder instead of its own, e.g. "
                           "FluxKontextPipeline or FluxInpaintPipeline on a FLUX.1 text-to-image folder")
    serve = commands.add_parser("serve", help="load the pipeline once on the mesh and serve HTTP requests "
                                              "(OpenAI-style /v1/images/generations; docs/serve.md)")
    add_model_options(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=_port, default=8000, help="TCP port to listen on")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on every endpoint but /health (default: the "
                            "PARADIFF_API_KEY environment variable, if set); a key given here shows in `ps`: prefer "
                            "--api-key-file or the variable")
    serve.add_argument("--api-key-file", default=None, metavar="PATH",
                       help="read the API key from this file (its first line), so it is not on the command line")
    serve.add_argument("--max-batch", type=_positive, default=1,
                       help="images per pipeline call: waiting requests of the same size, steps and guidance are "
                            "run together up to this many images (each keeps its own seed)")
    serve.add_argument("--batch-window", type=float, default=0.0,
                       help="seconds an idle server waits after a request for others to join its round (other "
                            "replicas, a batch); default 0: under load requests wait together anyway, and an idle "
                            "server adds no latency")
    serve.add_argument("--max-queue", type=_positive, default=64, help="waiting requests before new ones get 503")
    serve.add_argument("--schedule", choices=("fair", "fifo"), default="fair",
                       help="which waiting request a free replica takes: 'fair' (default) lets short requests pass "
                            "long ones that arrived within 4x their own expected run time; 'fifo' the oldest")
    serve.add_argument("--max-wait", type=float, default=None, metavar="SECONDS",
                       help="refuse a request up front (503, Retry-After) when its expected wait is above this "
                            "(default: no limit)")
    serve.add_argument("--request-timeout", type=float, default=600.0,
                       help="seconds from acceptance to answer; a request past it gets 504")
    serve.add_argument("--max-steps", type=_positive, default=None,
                       help="the most steps a request may ask (default: twice --steps)")
    serve.add_argument("--max-n", type=_positive, default=4, help="the most images one request may ask")
    serve.add_argument("--max-side", type=_positive, default=None,
                       help="the largest width or height a request may ask (default: twice the larger of --width "
                            "and --height, 128 for the embedded pipeline)")
    serve.add_argument("--max-frames", type=_positive, default=None,
                       help="the most frames a video request may ask (default: twice --frames; 257 without --frames)")
    serve.add_argument("--max-body-bytes", type=_positive, default=1 << 20,
                       help="largest request body (413 above; default 1 MiB)")
    serve.add_argument("--previews", choices=("linear", "vae", "off"), default="linear",
                       help="x0 previews of streamed images: a linear latent-to-RGB map fitted to the VAE at start "
                            "(default), the VAE itself (exact, a decoder call per preview), or none (docs/serve.md)")
    serve.add_argument("--read-timeout", type=float, default=10.0,
                       help="seconds a client has to send a request's headers, and then its body (default 10): a "
                            "slower connection is closed, a slower body answered 408")
    serve.add_argument("--allow-origin", action="append", default=None, metavar="ORIGIN",
                       help="a web page origin (e.g. https://app.example.com) whose browser requests are served, "
                            "with CORS headers; repeatable; by default requests that name another site's Origin "
                            "get 403")
    serve.add_argument("--allow-host", action="append", default=None, metavar="NAME[:PORT]",
                       help="a Host name served besides localhost, 127.0.0.1 and [::1] when bound to loopback (a "
                            "reverse proxy's name); repeatable; other Host headers get 403 (DNS rebinding)")
    serve.add_argument("--ray", action="store_true",
                       help="serve on Ray Serve: each Ray replica one mesh of these flags, Ray's HTTP proxy on "
                            "--host:--port (a local Ray cluster, or RAY_ADDRESS / --ray-address; docs/serve.md)")
    serve.add_argument("--ray-replicas", default="1", metavar="N|MIN:MAX",
                       help="with --ray: N replicas, or autoscaled from MIN to MAX on queued requests")
    serve.add_argument("--ray-route", choices=("none", "prompt-hash", "adapter"), default="none",
                       help="with --ray: send requests of the same prompt (prompt-hash) or adapters (adapter) to "
                            "the same replica while it is not overloaded")
    serve.add_argument("--ray-address", default=None, metavar="ADDRESS",
                       help="with --ray: the Ray cluster to join (default: RAY_ADDRESS, else a local one)")
    serve.add_argument("--ray-ingress", choices=("proxy", "haproxy"), default="proxy",
                       help="with --ray: what answers --host:--port: Ray Serve's HTTP proxy, or HAProxy forwarding "
                            "to the replicas' own ports (Ray's experimental HAProxy mode: ~8 ms less a request; a "
                            "local cluster only; its stats and metrics ports listen on all interfaces)")
    serve.add_argument("--lora-modules", nargs="+", action="extend", default=None, metavar="NAME=PATH",
                       help="adapters served per request, as vLLM takes them: each is a model id of its own "
                            "(\"model\": NAME); requests with different adapters still run in one call")
    serve.add_argument("--allow-runtime-lora", action="store_true",
                       help="take POST /v1/load_lora_adapter and /v1/unload_lora_adapter (files under --lora-root)")
    serve.add_argument("--lora-root", default=None, metavar="DIR",
                       help="the folder runtime adapter loads may read from (nothing outside it is read)")
    serve.add_argument("--max-loras", type=_positive, default=4,
                       help="adapters resident on the ranks at once (least recently used out first); also the most "
                            "distinct adapters in one pipeline call")
    serve.add_argument("--max-lora-rank", type=_positive, default=64, help="the largest adapter rank served")
    serve.add_argument("--out", default="out/serve",
                       help="the server's folder: requests.jsonl, one line per answered request; jobs.db, the video "
                            "jobs and their files (no request names a path)")
    serve.add_argument("--jobs-db", default=None, metavar="PATH|URL",
                       help="the store of the asynchronous video jobs and their results: a SQLite file (default: "
                            "jobs.db in --out) or a database URL, postgresql://user@host/db, which servers on several "
                            "machines share (the password from PGPASSWORD or ~/.pgpass); it survives restarts "
                            "(docs/serve.md)")
    serve.add_argument("--keep-results", default="100", metavar="N|AGE",
                       help="how long finished jobs' files are kept: a count of the newest (default 100) or an age "
                            "(30m, 12h, 7d); an expired job stays listed, its content answers 410")
    serve.add_argument("--pipeline", default=None, metavar="CLASS",
                       help="serve this diffusers pipeline class on the model folder instead of its own, e.g. "
                            "FluxImg2ImgPipeline or FluxInpaintPipeline: edits with a mask / strength "
                            "(POST /v1/images/edits)")
    serve.set_defaults(prompt=None, prompts_file=None, seed=0, compare=False, image=None, mask=None,
                       control_image=None, video=None, strength=None, controlnet_scale=None)
    bench = commands.add_parser("bench", help="time a list of configurations on one model")
    bench.add_argument("model", nargs="?", default=None, help="pipeline folder or Hub id; omitted: the embedded one")
    bench.add_argument("--configs", default="single,tp=2,ulysses=2,ring=2",
                       help="comma-separated list of configs; each is '+'-joined degrees, e.g. tp=2+ulysses=2")
    bench.add_argument("--steps", type=_positive, default=4, help="denoising steps per run")
    bench.add_argument("--height", type=_positive, default=64, help="image height in pixels")
    bench.add_argument("--width", type=_positive, default=64, help="image width in pixels")
    bench.add_argument("--frames", type=_positive, default=None, help="frames per video (video pipelines only)")
    bench.add_argument("--out", default="out/bench", help="output folder of the runs")
    check = commands.add_parser("check-plan", help="run a plan single-process vs parallel, module by module")
    check.add_argument("model", help="a diffusers class name (its built-in example) or a checkpoint folder")
    check.add_argument("--plan", default=None, help="'auto' or FILE.py defining tensor_parallel_plan(config)")
    check.add_argument("--cp-plan", default=None, help="'auto' or FILE.py defining context_parallel_plan(config)")
    check.add_argument("--tp", type=_positive, default=1, help="tensor-parallel degree")
    check.add_argument("--ulysses", type=_positive, default=1, help="Ulysses context-parallel degree")
    check.add_argument("--ring", type=_positive, default=1, help="ring-attention context-parallel degree")
    check.add_argument("--example", default=None, help="which built-in example of the class")
    check.add_argument("--inputs", default=None, help="FILE.py defining example_inputs(config, batch, grid, generator)")
    check.add_argument("--tolerance", type=float, default=1e-5,
                       help="largest max |difference| of a module's output that passes")
    check.add_argument("--all", action="store_true", help="print every module, not only the first 40 and the end")
    plans = commands.add_parser("plans", help="the coverage table, or a class's plan as a plan module")
    plans.add_argument("model", nargs="?", default=None, help="a diffusers class name")
    plans.add_argument("--auto", action="store_true", help="derive the plan from the structure (plan='auto')")
    plans.add_argument("--markdown", action="store_true", help="the coverage table as Markdown (docs/coverage.md)")
    plans.add_argument("--pipelines", action="store_true",
                       help="the pipeline coverage table instead (docs/pipeline-coverage.md)")
    plan = add_plan_parser(commands)
    for command in (gen, serve, bench, check, plans, plan):  # after the command too; SUPPRESS keeps `paradiff --debug CMD`
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    return parser


def world_size_of(args: argparse.Namespace) -> int:
    fsdp = getattr(args, "fsdp", 1) if args.ulysses * args.ring == 1 else 1  # FSDP shares the CP ranks
    return args.tp * args.ulysses * args.ring * args.cfg * args.dp * fsdp


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file:
        try:
            text = Path(args.prompts_file).read_text()
        except OSError as exc:
            raise CliError(f"cannot read --prompts-file {args.prompts_file}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise CliError(f"--prompts-file {args.prompts_file}: not UTF-8 text (byte {exc.start}: "
                           f"{exc.object[exc.start:exc.start + 1]!r}); save it as UTF-8") from None
        # a line ADAPTER<TAB>PROMPT: the prompt is after the tab (prompt_adapters reads the column)
        read = [line.split("\t", 1)[-1].strip() for line in text.splitlines() if line.strip()]
        if not read:
            raise CliError(f"--prompts-file {args.prompts_file} holds no prompt (one a line; blank lines are "
                           "skipped)")
        prompts += read
    if not prompts:
        from paradiff.demo import DEFAULT_PROMPTS

        prompts = list(DEFAULT_PROMPTS) if args.model is None else ["a red cube on a blue table"]
    return prompts


def prompt_adapters(args: argparse.Namespace) -> list[str | None] | None:
    """The --prompts-file's adapter column, one entry per prompt of read_prompts (None: no adapter; --prompt ones
    first, without), as --lora adapter names (lora0, lora1...); None when no line has the column."""
    if not args.prompts_file:
        return None
    try:
        lines = [line for line in Path(args.prompts_file).read_text().splitlines() if line.strip()]
    except OSError as exc:
        raise CliError(f"cannot read --prompts-file {args.prompts_file}: {exc.strerror}") from None
    if not any("\t" in line for line in lines):
        return None
    loras = lora_specs(args)
    if not loras:
        raise CliError(f"--prompts-file {args.prompts_file} has an adapter column: give the adapters with --lora")
    names = {lora["adapter_name"]: lora["adapter_name"] for lora in loras}
    stems = [Path(lora["path"]).name.removesuffix(".safetensors") for lora in loras]
    # a file name given twice (the same file at two scales) names neither: loraN does
    names.update({stem: lora["adapter_name"] for stem, lora in zip(stems, loras) if stems.count(stem) == 1})
    column: list[str | None] = [None] * len(args.prompt or [])
    for number, line in enumerate(lines, 1):
        label = line.split("\t", 1)[0].strip() if "\t" in line else "-"
        if label != "-" and label not in names:
            raise CliError(f"--prompts-file {args.prompts_file} line {number}: adapter {label!r} is not a --lora "
                           f"adapter; valid: {sorted(names) + ['-']}")
        column.append(None if label == "-" else names[label])
    return column


def _check_slot_adapter_files(args: argparse.Namespace) -> None:
    """An adapter column's --lora files adapt the transformer only: one with text-encoder tensors is refused here,
    from its header, before any worker starts."""
    from paradiff.api.lora_slots import safetensors_keys, text_encoder_refusal

    for lora in lora_specs(args):
        path = Path(lora["path"])
        if path.suffix != ".safetensors" or not path.is_file():
            continue
        try:
            keys = safetensors_keys(path)
        except (OSError, ValueError):
            continue  # not readable as safetensors: the load says why
        refusal = text_encoder_refusal(lora["adapter_name"], lora["path"], keys)
        if refusal is not None:
            raise CliError(f"--lora with an adapter column in --prompts-file: {refusal}")


def gguf_files(args: argparse.Namespace) -> dict[str, str]:
    """--gguf [COMPONENT=]FILE ... as {component: file} (COMPONENT defaults to "transformer"), each a local .gguf file
    that starts with GGUF's magic; a component given twice is an error."""
    files: dict[str, str] = {}
    for spec in getattr(args, "gguf", None) or []:
        name, sep, path = spec.partition("=")
        if not sep or not name.startswith("transformer"):
            name, path = "transformer", spec
        if name in files:
            raise CliError(f"--gguf {spec}: {name} already reads {files[name]}; give one file per transformer "
                           "(COMPONENT=FILE for another one, e.g. transformer_2=low_noise.gguf)")
        if not path.lower().endswith(".gguf"):
            raise CliError(f"--gguf {spec}: expected a .gguf file")
        try:
            with open(path, "rb") as handle:
                magic = handle.read(4)
        except OSError as exc:
            raise CliError(f"--gguf {spec}: cannot read {path} ({exc.strerror}); download the file first") from None
        if magic != b"GGUF":
            raise CliError(f"--gguf {spec}: {path} is not a GGUF file (no 'GGUF' magic)")
        files[name] = path
    return files


def cache_config(spec: str, model=None):
    """The diffusers cache config for a --cache SPEC (api/load_spec.py: cache_config), or a CliError saying what a
    valid SPEC looks like."""
    from paradiff.api.load_spec import cache_config as spec_cache_config
    from paradiff.errors import LoadSpecError

    try:
        return spec_cache_config(spec, model)
    except LoadSpecError as exc:
        raise flag_error(exc) from None


def default_steps(args: argparse.Namespace) -> int:
    """--steps when not given: 4; the embedded pipeline's own count when no model is given."""
    from paradiff.demo import DEFAULT_STEPS

    return DEFAULT_STEPS if args.model is None else 4


def check_args(args: argparse.Namespace) -> None:
    """Everything a user can get wrong, checked before any process starts or any weight is read; also fills in the
    defaults that depend on the model (the launcher and every worker run this)."""
    if args.steps is None:
        args.steps = default_steps(args)
    if args.cache is not None:
        cache_config(args.cache)
    if args.model is not None:
        path = Path(args.model)
        from paradiff.io.folders import INDEX_FILES

        if (path.exists() or args.model.startswith((".", "/"))) and not any((path / name).is_file()
                                                                             for name in INDEX_FILES):
            raise CliError(f"model folder {args.model} does not exist or has no model_index.json (nor a Modular "
                           "Diffusers modular_model_index.json)")
    prompts = read_prompts(args)
    blank = next((prompt for prompt in prompts if not prompt.strip()), None)
    if blank is not None:
        raise CliError(f"--prompt {blank!r}: expected a non-empty prompt (an empty one draws noise, and serve refuses "
                       "it too)")
    seed = getattr(args, "seed", 0)
    if not 0 <= seed <= SEED_MAX - (len(prompts) - 1):
        raise CliError(f"--seed {seed}: expected an integer from 0 to 2**63 - {len(prompts)} (prompt i uses seed + i, "
                       "which torch's generators take up to 2**63 - 1, as serve does)")
    if getattr(args, "compile_backend", None) is not None and not args.compile:
        raise CliError(f"--compile-backend {args.compile_backend} without --compile: nothing is compiled; give "
                       "--compile too, or drop --compile-backend")
    if getattr(args, "device_memory", None) is not None and not getattr(args, "dry_run", False):
        raise CliError(f"--device-memory {args.device_memory:g} without --dry-run: it sizes the dry run's advice; "
                       "give --dry-run too, or drop --device-memory")
    if getattr(args, "world", None) is not None and getattr(args, "parallel", None) != "auto":
        raise CliError(f"--world {args.world} without --parallel auto: the mesh comes from the degrees given; give "
                       "--parallel auto to plan one for that many ranks, or drop --world")
    if getattr(args, "attention_backend", None) is not None:
        _check_attention_backend(args.attention_backend, args.ring)
    if getattr(args, "lora_weight_name", None) is not None and not lora_specs(args):
        raise CliError(f"--lora-weight-name {args.lora_weight_name} picks a file of a --lora folder or repo: give "
                       "--lora too, or drop --lora-weight-name")
    for lora in lora_specs(args):
        path = Path(lora["path"])
        if (lora["path"].startswith((".", "/")) or path.suffix == ".safetensors") and not path.exists():
            raise CliError(f"--lora {lora['path']}: no such file or folder")
    if getattr(args, "prompts_file", None) and prompt_adapters(args) is not None:
        _check_slot_adapter_files(args)
        for flag in ("also_without_lora", "compare", "stages"):
            if getattr(args, flag, False):
                raise CliError(f"--{flag.replace('_', '-')} with an adapter column in --prompts-file: not supported "
                               "(each prompt runs its own adapter in mixed batches); drop one of them")
    if getattr(args, "also_without_lora", False) and not lora_specs(args):
        raise CliError("--also-without-lora draws each prompt without and with the --lora adapters: give --lora too")
    if getattr(args, "also_without_lora", False) and args.stages:
        raise CliError("--also-without-lora with --stages: a staged run draws its prompts as one batch with one set "
                       "of adapters; drop one of the two")
    for flag, value in (("--plan", args.plan), ("--cp-plan", args.cp_plan)):
        if value not in (None, "auto") and not Path(value).is_file():
            raise CliError(f"{flag} {value}: expected 'auto' or a plan file (FILE.py); no such file")
    _check_video(args)
    check_conditioning(args)
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".paradiff-write-test-{os.getpid()}"  # one per process: every worker checks too
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        what = "is a file, not a folder" if out.is_file() else f"is not writable: {exc.strerror}"
        raise CliError(f"output folder {args.out} {what}") from None
    if args.height % 16 or args.width % 16:
        raise CliError(f"--height {args.height} and --width {args.width} must be multiples of 16 (VAE x patch size)")
    if getattr(args, "quantize_skip", None) is not None and not getattr(args, "quantize", None):
        raise CliError(f"--quantize-skip {args.quantize_skip} names modules --quantize leaves unquantized: give "
                       "--quantize int8|fp8|nf4 too")
    if getattr(args, "quantize_skip", None) is not None and not quantize_skip(args):
        raise CliError(f"--quantize-skip {args.quantize_skip!r}: expected module names, e.g. context_embedder or "
                       "context_embedder,x_embedder")
    if getattr(args, "quantize_text_encoders", False) and not getattr(args, "quantize", None):
        raise CliError("--quantize-text-encoders quantizes the text encoders with the --quantize scheme: give "
                       "--quantize int8|fp8|nf4 too")
    if gguf_files(args) and getattr(args, "quantize", None):
        raise CliError(f"--gguf with --quantize {args.quantize}: a GGUF file's weights are already quantized "
                       "(in the file's own types); drop --quantize")
    _check_fsdp(args)
    import torch

    world = world_size_of(args)
    if torch.cuda.is_available() and "RANK" not in os.environ and world > torch.cuda.device_count():
        raise CliError(f"{world} processes requested but only {torch.cuda.device_count()} GPU(s) are visible")


def _check_attention_backend(name: str, ring: int) -> None:
    """--attention-backend: a backend this machine runs and, with --ring, one returning the log-sum-exp (the device
    and dtype are checked by each worker, before it reads a weight)."""
    from paradiff.attention.backends import check_choice
    from paradiff.errors import ParallelConfigError

    try:
        check_choice(name, ring)
    except ParallelConfigError as exc:
        raise CliError(f"--attention-backend {name}: {exc}") from None


def _check_fsdp(args: argparse.Namespace) -> None:
    fsdp, cp = getattr(args, "fsdp", 1), args.ulysses * args.ring
    if fsdp == 1:
        if getattr(args, "fsdp_offload", False):
            raise CliError("--fsdp-offload without --fsdp N (N > 1): the offload keeps FSDP's shards in CPU memory; "
                           "add --fsdp")
        return
    if cp > 1 and fsdp != cp:
        raise CliError(f"--fsdp {fsdp} with --ulysses {args.ulysses} --ring {args.ring}: FSDP shards over the "
                       f"sequence-parallel ranks, so --fsdp must be {cp} (or 1)")
    if args.stages:
        raise CliError(f"--fsdp {fsdp} with --stages: FSDP keeps each rank's rows resident, a staged run frees "
                       "and re-reads whole components (docs/fsdp.md); drop one of the two")
    if getattr(args, "quantize", None) == "nf4":
        raise CliError(f"--fsdp {fsdp} with --quantize nf4: FSDP2 cannot cut bitsandbytes' 4-bit weights by rows "
                       "(docs/fsdp.md); use --quantize int8 or fp8 with --fsdp, or nf4 without it")
    if (getattr(args, "quantize", None) or gguf_files(args)) and args.tp > 1:
        raise CliError(f"--fsdp {fsdp} with --tp {args.tp} and a quantized base: quantized FSDP shards whole rows "
                       "of each weight, not of a TP slice (docs/fsdp.md); drop --tp or --fsdp")


def _check_video(args: argparse.Namespace) -> None:
    """--frames needs a video pipeline, and a video pipeline needs PyAV to write MP4 files."""
    if args.frames is not None and args.model is None:
        raise CliError("--frames needs a video pipeline; the embedded default pipeline makes images")
    has_av = importlib.util.find_spec("av") is not None
    if args.frames is None and has_av:
        return
    makes_video = _makes_video(args.model)
    if args.frames is not None and makes_video is False:
        raise CliError(f"--frames needs a video pipeline, but {args.model} makes images (its pipeline's __call__ "
                       "takes no num_frames)")
    if makes_video and not has_av:
        raise CliError(f"{args.model} makes videos, which are written with PyAV: pip install 'paradiff[video]'")


def _makes_video(model: str | None) -> bool | None:
    """Whether the pipeline in folder `model` makes videos (its call takes `num_frames`), read from its index before
    any weight; None when unknown (a Hub id, a custom pipeline class)."""
    if model is None:
        return False
    from paradiff.io.folders import INDEX_FILES, read_pipeline_index

    if not any((Path(model) / name).is_file() for name in INDEX_FILES):
        return None
    import diffusers

    pipeline_class = getattr(diffusers, str(read_pipeline_index(model).class_name), None)
    if pipeline_class is None:
        return None
    parameters = call_parameter_names(pipeline_class, Path(model))
    return None if parameters is None else "num_frames" in parameters
