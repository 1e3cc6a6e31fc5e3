"""The autotune driver behind `ttftc autotune`: time each candidate config of a model's ops (tuner.py, with the
timers of timing.py) and the chunk size of chunked prefill (chunking.py), and store the winners in the core cache
(ttftc.autotune.cache). api.tune_model runs it for one model. A tool: compilation only reads the cache."""
