"""The forms of the deepspeed functions pyvene_dist's fixes depend on (``versions.forms``). Generated: after a
run passes on other releases, ``python -m pyvene_dist.fix_list --record`` adds their forms (``--source DIR
--release NAME=RELEASE`` a source tree's). Edit by re-recording, not by hand."""

from typing import Final

#: Target -> {source fingerprint: the releases it was seen and tested with}.
KNOWN: Final = {
    'deepspeed.runtime.engine:DeepSpeedEngine.load_checkpoint': {
        'b06341e8eb59be93': ('0.19.8',),
    },
    'deepspeed.runtime.engine:DeepSpeedEngine.save_checkpoint': {
        '2728646fe06179e8': ('0.19.8',),
    },
}

#: Module -> {digest of a file recorded: {function: its fingerprint there}}: a file as recorded is not read.
FILES: Final = {
    'deepspeed.runtime.engine': {
        'e35eaa313874d2b3': {
            'DeepSpeedEngine.load_checkpoint': 'b06341e8eb59be93',
            'DeepSpeedEngine.save_checkpoint': '2728646fe06179e8',
        },
    },
}
