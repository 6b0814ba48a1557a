"""The forms of the accelerate functions pyvene_dist's fixes depend on (``versions.forms``). Generated: after a
run passes on other releases, ``python -m pyvene_dist.fix_list --record`` adds their forms (``--source DIR
--release NAME=RELEASE`` a source tree's). Edit by re-recording, not by hand."""

from typing import Final

#: Target -> {source fingerprint: the releases it was seen and tested with}.
KNOWN: Final = {
    'accelerate.utils.fsdp_utils:fsdp2_load_full_state_dict': {
        '69748ae09908b5a3': ('1.16.0',),
        '0831ed67838449ec': ('1.15.0',),
    },
    'accelerate.utils.fsdp_utils:save_fsdp_model': {
        '0ad60b659f961a60': ('1.15.0', '1.16.0'),
    },
    'accelerate.utils:save_fsdp_model': {
        '0ad60b659f961a60': ('1.15.0', '1.16.0'),
    },
}

#: Module -> {digest of a file recorded: {function: its fingerprint there}}: a file as recorded is not read.
FILES: Final = {
    'accelerate.utils.fsdp_utils': {
        '17b1ea8cc5c7646a': {
            'fsdp2_load_full_state_dict': '69748ae09908b5a3',
            'save_fsdp_model': '0ad60b659f961a60',
        },
        '65ef8a04aaa0c68d': {
            'fsdp2_load_full_state_dict': '0831ed67838449ec',
            'save_fsdp_model': '0ad60b659f961a60',
        },
    },
}
