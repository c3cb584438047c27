"""kvfleet: reuse, migrate and tier the KV cache of a fleet of LLM model servers.

Layers (import only downwards, checked by import-linter, see ``.importlinter``):

====================  ===========================================================
``kvfleet.cli``       command line: ``kvfleet operator|epp|agent|engine|demo``
``kvfleet.demo``      the one-machine stack (Envoy + EPP + engines) and its report
``kvfleet.engine``    the CPU-fallback engine simulator (a vLLM-like pod)
``kvfleet.operator``  kopf operator for KVCachePool / InferencePool
``kvfleet.epp``       Envoy ext_proc endpoint picker and the global block index
``kvfleet.agent``     node agent: tiers, codecs, transfer engine
``kvfleet.config``    settings dataclasses, the single source of configuration
``kvfleet.cache``     the KV-cache core: block hashing, block manager, radix tree, KV events
====================  ===========================================================
"""

__version__ = "0.1.0"
