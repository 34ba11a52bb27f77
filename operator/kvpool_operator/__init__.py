"""kvpool's Kubernetes operator: KVPool, KVTier and TenantNamespace into store pods, ring and status.

Layout (DESIGN §8, STYLE 1–3): pure planners and builders decide (``model``, ``children``,
``membership``, ``scaling``, ``drain``, ``status``, ``injection``, ``tenancy``); ``kube`` is the
only module that talks to the Kubernetes API and ``nodes`` the only one that talks to store nodes;
``handlers`` are thin kopf adapters; ``main`` runs kopf.
"""

__version__ = "0.1.0"
