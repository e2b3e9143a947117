"""MindSpeed-LLM's arguments: Megatron's parser plus every feature's flags, then the features'
validation around Megatron's (the real one wraps ``megatron.training``'s parse/validate)."""

import argparse
import sys

from mindspeed.features_manager.features_manager import MindSpeedFeaturesManager

import mindspeed_llm.features_manager  # noqa: F401  (sets the features list)

_ARGS = None


def _parser():
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--context-parallel-size", type=int, default=1)
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--num-experts", type=int, default=None)
    parser.add_argument("--num-micro-batches", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=1)
    MindSpeedFeaturesManager.register_features_args(parser)
    return parser


def parse_known_args(argv=None):
    """The adaptor's early parse: known flags only (the rest is left for Megatron)."""
    args, _ = _parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    args.optimization_level = 2
    return args


def parse_args(argv):
    """Megatron's parse_args + validate_args as MindSpeed-LLM wraps them; sets the global args."""
    global _ARGS
    args = _parser().parse_args(argv)
    args.optimization_level = 2
    MindSpeedFeaturesManager.pre_validate_features_args(args)
    MindSpeedFeaturesManager.post_validate_features_args(args)
    MindSpeedFeaturesManager.validate_features_args(args)
    _ARGS = args
    return args


def get_args():
    return _ARGS
