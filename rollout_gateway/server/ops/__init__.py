"""The process around the gateway: metrics (:mod:`.metrics`), memory given back to the OS
(:mod:`.memory`) and the garbage collector's settings (:mod:`.gc_tuning`)."""
