"""Tandem's wire contract: message types, topology model, subject names, codecs.

Everything two services must agree on lives here and nowhere else. See ``messages`` for the
flow, ``topology`` for the node tree / topology file format, ``subjects`` for names, and
``codec`` for the prebuilt msgpack/JSON encoders and decoders.
"""

from schemas import codec, messages, subjects, topology

__all__ = ["codec", "messages", "subjects", "topology"]
