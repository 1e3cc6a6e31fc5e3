"""`ttftc compile` run: what the parsed arguments of ttftc/commands/compile.py do."""

from __future__ import annotations

import time

from ttftc.aot import ArtifactError, build_artifact, read_manifest, rebuild_artifact
from ttftc.cache import default_cache
from ttftc.commands import UsageError, parse_passes
from ttftc.config import Config
from ttftc.models import ModelInputError


def run(args) -> int:
    started = time.perf_counter()
    try:
        if args.rebuild:
            directory = rebuild_artifact(args.output, model_name=args.model, cache=default_cache())
        else:
            if not args.model:
                raise UsageError("MODEL is required (or pass --rebuild to rebuild DIR from its manifest)")
            passes = parse_passes(args.passes)
            try:
                config = Config(passes=passes, precision=args.precision, buckets=args.buckets, provider=args.provider)
            except ValueError as exc:
                raise UsageError(str(exc)) from None
            directory = build_artifact(args.model, args.output, config, batch_sizes=args.batch, logits=args.logits,
                                       kv=not args.no_kv, cache=default_cache())
    except (ArtifactError, ModelInputError) as exc:
        raise UsageError(str(exc)) from None
    manifest = read_manifest(directory)
    print(f"wrote {directory} in {time.perf_counter() - started:.1f} s: buckets {manifest['buckets']}, "
          f"{len(manifest['signatures'])} graph(s), precision {manifest['config']['precision']}")
    return 0
