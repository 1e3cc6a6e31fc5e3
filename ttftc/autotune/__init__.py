"""The core of kernel autotuning: search spaces (space.py), cache keys (keys.py) and the persistent, versioned
cache of winners (cache.py), which compilation reads. The driver that measures and fills the cache
(`ttftc autotune`) is a tool, in ttftc.tuning; this package never imports it."""
