"""The forms of the pyvene functions pyvene_dist's fixes depend on (``versions.forms``). Generated: after a
run passes on other releases, ``python -m pyvene_dist.fix_list --record`` adds their forms (``--source DIR
--release NAME=RELEASE`` a source tree's). Edit by re-recording, not by hand."""

from typing import Final

#: Target -> {source fingerprint: the releases it was seen and tested with}.
KNOWN: Final = {
    'pyvene.models.basic_utils:count_parameters': {
        '549d19d8c59a6798': ('0.1.8',),
    },
    'pyvene.models.intervenable_base:BaseModel.__init__': {
        '019aa10e8e53cdff': ('0.1.8',),
    },
    'pyvene.models.intervenable_base:BaseModel._input_validation': {
        '5659cdcd0bcbc7c7': ('0.1.8',),
    },
    'pyvene.models.intervenable_base:BaseModel.count_parameters': {
        'bd532425a939e433': ('0.1.8',),
    },
    'pyvene.models.intervenable_base:BaseModel.get_device': {
        'b93592865810c3c5': ('0.1.8',),
    },
    'pyvene.models.intervenable_base:BaseModel.named_parameters': {
        'e52cb39a23126512': ('0.1.8',),
    },
    'pyvene.models.intervenable_base:BaseModel.set_device': {
        '778f99bd7e8c8cd1': ('0.1.8',),
        'affc2443602276e7': ('0.1.8+patches',),
    },
    'pyvene.models.intervenable_base:BaseModel.zero_grad': {
        '1c63e00216189246': ('0.1.8',),
    },
    'pyvene.models.intervenable_base:IntervenableModel.__init__': {
        'c8939722b05bbcc1': ('0.1.8',),
    },
    'pyvene.models.intervenable_base:IntervenableModel._intervention_getter': {
        '4e84da2cde3c56dd': ('0.1.8',),
    },
    'pyvene.models.intervenable_base:IntervenableModel._intervention_setter': {
        'd910a91852d0a2d2': ('0.1.8',),
    },
    'pyvene.models.intervenable_base:IntervenableModel._output_validation': {
        '3abe304ddab8709c': ('0.1.8',),
    },
    'pyvene.models.intervenable_base:IntervenableModel._reconcile_stateful_cached_activations': {
        '390731e6df202965': ('0.1.8',),
    },
    'pyvene.models.intervenable_base:IntervenableModel._remove_forward_hooks': {
        'f76d928fd9d68878': ('0.1.8',),
    },
    'pyvene.models.intervenable_base:IntervenableModel._wait_for_forward_with_parallel_intervention': {
        'f4358f4e3dec7fb4': ('0.1.8',),
    },
    'pyvene.models.intervenable_base:IntervenableModel._wait_for_forward_with_serial_intervention': {
        '13fb41dbaa2e8042': ('0.1.8',),
    },
    'pyvene.models.intervenable_base:IntervenableModel.eval': {
        '3d3307ad116ecba0': ('0.1.8',),
    },
    'pyvene.models.intervenable_base:IntervenableModel.forward': {
        '743628762e997fbf': ('0.1.8',),
    },
    'pyvene.models.intervenable_base:IntervenableModel.generate': {
        'c81e261a7029aa42': ('0.1.8',),
    },
    'pyvene.models.intervenable_base:IntervenableModel.load': {
        '78e7ca82bcc7d743': ('0.1.8',),
    },
    'pyvene.models.intervenable_base:IntervenableModel.load_intervention': {
        'f8a2b60e835d33e2': ('0.1.8',),
    },
    'pyvene.models.intervenable_base:IntervenableModel.save': {
        '106eeb1f32746edc': ('0.1.8',),
    },
    'pyvene.models.intervenable_base:IntervenableModel.save_intervention': {
        '19611e1304ec39d4': ('0.1.8',),
    },
    'pyvene.models.intervenable_base:IntervenableModel.train': {
        '24bda36b913e4fe1': ('0.1.8',),
    },
    'pyvene.models.intervenable_base:count_parameters': {
        '549d19d8c59a6798': ('0.1.8',),
    },
    'pyvene.models.intervenable_base:do_intervention': {
        '5c6d4b19fd219158': ('0.1.8',),
    },
    'pyvene.models.intervenable_base:gather_neurons': {
        '5bb3f955897f8a14': ('0.1.8',),
    },
    'pyvene.models.intervenable_base:get_module_hook': {
        '8abcc314a6463c59': ('0.1.8',),
    },
    'pyvene.models.intervenable_base:scatter_neurons': {
        '2963dcb49e1582fd': ('0.1.8',),
    },
    'pyvene.models.modeling_utils:do_intervention': {
        '5c6d4b19fd219158': ('0.1.8',),
    },
    'pyvene.models.modeling_utils:gather_neurons': {
        '5bb3f955897f8a14': ('0.1.8',),
    },
    'pyvene.models.modeling_utils:get_module_hook': {
        '8abcc314a6463c59': ('0.1.8',),
    },
    'pyvene.models.modeling_utils:scatter_neurons': {
        '2963dcb49e1582fd': ('0.1.8',),
    },
}

#: Module -> {digest of a file recorded: {function: its fingerprint there}}: a file as recorded is not read.
FILES: Final = {
    'pyvene.models.basic_utils': {
        'e92cd3373e488b62': {
            'count_parameters': '549d19d8c59a6798',
        },
    },
    'pyvene.models.intervenable_base': {
        'd8d084ed1f01e028': {
            'BaseModel.__init__': '019aa10e8e53cdff',
            'BaseModel._input_validation': '5659cdcd0bcbc7c7',
            'BaseModel.count_parameters': 'bd532425a939e433',
            'BaseModel.get_device': 'b93592865810c3c5',
            'BaseModel.named_parameters': 'e52cb39a23126512',
            'BaseModel.set_device': '778f99bd7e8c8cd1',
            'BaseModel.zero_grad': '1c63e00216189246',
            'IntervenableModel.__init__': 'c8939722b05bbcc1',
            'IntervenableModel._intervention_getter': '4e84da2cde3c56dd',
            'IntervenableModel._intervention_setter': 'd910a91852d0a2d2',
            'IntervenableModel._output_validation': '3abe304ddab8709c',
            'IntervenableModel._reconcile_stateful_cached_activations': '390731e6df202965',
            'IntervenableModel._remove_forward_hooks': 'f76d928fd9d68878',
            'IntervenableModel._wait_for_forward_with_parallel_intervention': 'f4358f4e3dec7fb4',
            'IntervenableModel._wait_for_forward_with_serial_intervention': '13fb41dbaa2e8042',
            'IntervenableModel.eval': '3d3307ad116ecba0',
            'IntervenableModel.forward': '743628762e997fbf',
            'IntervenableModel.generate': 'c81e261a7029aa42',
            'IntervenableModel.load': '78e7ca82bcc7d743',
            'IntervenableModel.load_intervention': 'f8a2b60e835d33e2',
            'IntervenableModel.save': '106eeb1f32746edc',
            'IntervenableModel.save_intervention': '19611e1304ec39d4',
            'IntervenableModel.train': '24bda36b913e4fe1',
        },
    },
    'pyvene.models.modeling_utils': {
        'cd0f0049ef92445f': {
            'do_intervention': '5c6d4b19fd219158',
            'gather_neurons': '5bb3f955897f8a14',
            'get_module_hook': '8abcc314a6463c59',
            'scatter_neurons': '2963dcb49e1582fd',
        },
    },
}
