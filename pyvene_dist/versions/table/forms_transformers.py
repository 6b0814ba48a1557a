"""The forms of the transformers functions pyvene_dist's fixes depend on (``versions.forms``). Generated: after a
run passes on other releases, ``python -m pyvene_dist.fix_list --record`` adds their forms (``--source DIR
--release NAME=RELEASE`` a source tree's). Edit by re-recording, not by hand."""

from typing import Final

#: Target -> {source fingerprint: the releases it was seen and tested with}.
KNOWN: Final = {
    'transformers.activations:LinearActivation.forward': {
        'e9cadc4c0a27bfd2': ('5.17.0', '5.24.0', '5.25.0'),
    },
    'transformers.modeling_utils:PreTrainedModel._load_pretrained_model': {
        'eaf18c636725f700': ('5.24.0', '5.25.0'),
        '26d8068b570038a9': ('5.17.0',),
    },
    'transformers.trainer:Trainer._inner_training_loop': {
        '3b8b7359ad087d87': ('5.24.0', '5.25.0'),
        '9ef1f2a6b8d4d8bb': ('5.17.0',),
    },
    'transformers.trainer:Trainer._load_from_checkpoint': {
        '1fa7425d1ea7cc18': ('5.24.0', '5.25.0'),
        '39f4f0890ea22740': ('5.17.0',),
    },
    'transformers.trainer:Trainer._set_signature_columns_if_needed': {
        'e10ded1c3e2e5f24': ('5.17.0', '5.24.0', '5.25.0'),
    },
    'transformers.trainer:Trainer.compute_loss': {
        '30eb16e597ada0b9': ('5.24.0', '5.25.0'),
        '1d58d1479f8f5989': ('5.17.0',),
    },
    'transformers.trainer:Trainer.create_accelerator_and_postprocess': {
        '8ce6b18b6c682c6e': ('5.24.0', '5.25.0'),
        '59675ab578b3239c': ('5.17.0',),
    },
    'transformers.trainer:Trainer.evaluate': {
        'ce448ad06606289f': ('5.17.0', '5.24.0', '5.25.0'),
    },
    'transformers.trainer:Trainer.evaluation_loop': {
        '0e78695b50b6d6e1': ('5.24.0', '5.25.0'),
        '47b0aff6d8d4acdf': ('5.17.0',),
    },
    'transformers.trainer:Trainer.get_decay_parameter_names': {
        '5b5b4ea618c87dd8': ('5.17.0', '5.24.0', '5.25.0'),
    },
    'transformers.trainer:Trainer.train': {
        '0bc847a1e101c362': ('5.24.0', '5.25.0'),
        'e8a272bcd2dbc9ef': ('5.17.0',),
    },
    'transformers.trainer:save_fsdp_model': {
        '0ad60b659f961a60': ('5.24.0',),
    },
}

#: Module -> {digest of a file recorded: {function: its fingerprint there}}: a file as recorded is not read.
FILES: Final = {
    'transformers.activations': {
        '5b20c0a3625edc00': {
            'LinearActivation.forward': 'e9cadc4c0a27bfd2',
        },
    },
    'transformers.modeling_utils': {
        '13cfe87b11350fd7': {
            'PreTrainedModel._load_pretrained_model': 'eaf18c636725f700',
        },
        '38c2bd02ed7af229': {
            'PreTrainedModel._load_pretrained_model': '26d8068b570038a9',
        },
        'b2dcf15dc848dcd6': {
            'PreTrainedModel._load_pretrained_model': 'eaf18c636725f700',
        },
    },
    'transformers.trainer': {
        '87e1c73bc1263027': {
            'Trainer._inner_training_loop': '3b8b7359ad087d87',
            'Trainer._load_from_checkpoint': '1fa7425d1ea7cc18',
            'Trainer._set_signature_columns_if_needed': 'e10ded1c3e2e5f24',
            'Trainer.compute_loss': '30eb16e597ada0b9',
            'Trainer.create_accelerator_and_postprocess': '8ce6b18b6c682c6e',
            'Trainer.evaluate': 'ce448ad06606289f',
            'Trainer.evaluation_loop': '0e78695b50b6d6e1',
            'Trainer.get_decay_parameter_names': '5b5b4ea618c87dd8',
            'Trainer.train': '0bc847a1e101c362',
        },
        '1bb62572e150a929': {
            'Trainer._inner_training_loop': '9ef1f2a6b8d4d8bb',
            'Trainer._load_from_checkpoint': '39f4f0890ea22740',
            'Trainer._set_signature_columns_if_needed': 'e10ded1c3e2e5f24',
            'Trainer.compute_loss': '1d58d1479f8f5989',
            'Trainer.create_accelerator_and_postprocess': '59675ab578b3239c',
            'Trainer.evaluate': 'ce448ad06606289f',
            'Trainer.evaluation_loop': '47b0aff6d8d4acdf',
            'Trainer.get_decay_parameter_names': '5b5b4ea618c87dd8',
            'Trainer.train': 'e8a272bcd2dbc9ef',
        },
        '44ce713470a301ec': {
            'Trainer._inner_training_loop': '3b8b7359ad087d87',
            'Trainer._load_from_checkpoint': '1fa7425d1ea7cc18',
            'Trainer._set_signature_columns_if_needed': 'e10ded1c3e2e5f24',
            'Trainer.compute_loss': '30eb16e597ada0b9',
            'Trainer.create_accelerator_and_postprocess': '8ce6b18b6c682c6e',
            'Trainer.evaluate': 'ce448ad06606289f',
            'Trainer.evaluation_loop': '0e78695b50b6d6e1',
            'Trainer.get_decay_parameter_names': '5b5b4ea618c87dd8',
            'Trainer.train': '0bc847a1e101c362',
        },
    },
}
