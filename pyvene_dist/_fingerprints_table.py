"""The forms of the functions pyvene_dist's fixes depend on (``_fingerprints``). Generated: after a run
passes on other releases, ``python -m pyvene_dist.fix_list --record`` adds their forms (``--source DIR
--release NAME=RELEASE`` a source tree's). Edit by re-recording, not by hand."""

#: Target -> {source fingerprint: the releases it was seen and tested with}.
KNOWN = {
    'pyreft.interventions:LoreftIntervention.load_state_dict': {
        '797643a93e01499d': ('0.1.0', '0.1.0+git.dafd099'),
    },
    'pyreft.interventions:LoreftIntervention.state_dict': {
        '07236ec6ab265091': ('0.1.0', '0.1.0+git.dafd099'),
    },
    'pyreft.reft_model:ReftModel.print_trainable_parameters': {
        '314db834fd8f252a': ('0.1.0', '0.1.0+git.dafd099'),
    },
    'pyreft.reft_model:count_parameters': {
        '549d19d8c59a6798': ('0.1.0', '0.1.0+git.dafd099'),
    },
    'pyreft.reft_trainer:ReftTrainer._load_best_model': {
        'fc4eb385db1cc379': ('0.1.0',),
        '83eefb4304d78792': ('0.1.0+git.dafd099',),
    },
    'pyreft.reft_trainer:ReftTrainer.compute_loss': {
        'eeebbc91829a7972': ('0.1.0',),
        'ae4794cd68435e1e': ('0.1.0+git.dafd099',),
    },
    'pyreft.reft_trainer:ReftTrainer.save_model': {
        'd474bae7d6bf39cc': ('0.1.0',),
        '983e15605f290488': ('0.1.0+git.dafd099',),
    },
    'pyreft.reft_trainer:ReftTrainerForCausalLM.get_train_dataloader': {
        '5d116c2d76a8b831': ('0.1.0', '0.1.0+git.dafd099'),
    },
    'pyreft.reft_trainer:ReftTrainerForCausalLMDistributed.get_train_dataloader': {
        'e295c425aee95caf': ('0.1.0', '0.1.0+git.dafd099'),
    },
    'pyreft.reft_trainer:ReftTrainerForCausalLMDistributed.save_model': {
        '0b6d3f310fbfca11': ('0.1.0', '0.1.0+git.dafd099'),
    },
    'pyreft.reft_trainer:ReftTrainerForSequenceClassification.compute_loss': {
        'a98b85688fdb4aa6': ('0.1.0', '0.1.0+git.dafd099'),
    },
    'pyreft.reft_trainer:ReftTrainerForSequenceClassification.evaluate': {
        'a59f16e74668a8d4': ('0.1.0', '0.1.0+git.dafd099'),
    },
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
    'torch.distributed.fsdp._fully_shard._fully_shard:fully_shard': {
        '9a3296bbf4f8f895': ('2.13.0',),
        '52398820d16a2361': ('2.11.0',),
        'f18b191885f51a62': ('2.15.0',),
    },
    'torch.distributed.fsdp._fully_shard:fully_shard': {
        '9a3296bbf4f8f895': ('2.13.0',),
        '52398820d16a2361': ('2.11.0',),
        'f18b191885f51a62': ('2.15.0',),
    },
    'torch.distributed.fsdp.fully_sharded_data_parallel:FullyShardedDataParallel.__init__': {
        '9fbb399e395565a8': ('2.11.0', '2.13.0', '2.15.0'),
    },
    'torch.distributed.fsdp:fully_shard': {
        '9a3296bbf4f8f895': ('2.13.0',),
        '52398820d16a2361': ('2.11.0',),
        'f18b191885f51a62': ('2.15.0',),
    },
    'torch.nn.functional:dropout': {
        'de4ee9f332ff8254': ('2.11.0', '2.13.0', '2.15.0'),
    },
    'torch.nn.modules.dropout:Dropout.forward': {
        '00f268cdc994d862': ('2.11.0', '2.13.0', '2.15.0'),
    },
    'torch.nn.modules.linear:Linear.forward': {
        '76181b0142f43480': ('2.11.0', '2.13.0', '2.15.0'),
    },
    'torch.nn.modules.module:Module._call_impl': {
        'b3e906e8894df01a': ('2.11.0', '2.13.0'),
        'b2dda8540637847d': ('2.15.0',),
    },
    'torch.nn.parallel.data_parallel:DataParallel.replicate': {
        '24085ea5d58aa1fd': ('2.11.0', '2.13.0', '2.15.0'),
    },
    'torch.nn.parallel.data_parallel:DataParallel.scatter': {
        'b9e3e06ec85907e8': ('2.11.0', '2.13.0', '2.15.0'),
    },
    'torch.nn.parallel.distributed:DistributedDataParallel.__init__': {
        'c3b695e1e6bf23f3': ('2.13.0',),
        'b24e2b1453cbc8be': ('2.11.0',),
        'bcfa8765fb8cba7c': ('2.15.0',),
    },
    'torch.nn.parallel.replicate:replicate': {
        '83ae0960fdb0d08d': ('2.13.0', '2.15.0'),
        '1a142bee24785c03': ('2.11.0',),
    },
    'torch.nn.utils.parametrizations:_Orthogonal.forward': {
        '5bfb105bed649a2b': ('2.11.0', '2.13.0', '2.15.0'),
    },
    'transformers.activations:LinearActivation.forward': {
        'e9cadc4c0a27bfd2': ('5.17.0', '5.24.0', '5.25.0'),
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
    'transformers.trainer:Trainer.get_decay_parameter_names': {
        '5b5b4ea618c87dd8': ('5.17.0', '5.24.0', '5.25.0'),
    },
    'transformers.trainer:Trainer.train': {
        '0bc847a1e101c362': ('5.24.0', '5.25.0'),
        'e8a272bcd2dbc9ef': ('5.17.0',),
    },
}

#: Module -> {digest of a file recorded: {function: its fingerprint there}}: a file as recorded is not read.
FILES = {
    'pyreft.interventions': {
        'ecd9f0cdea62bafe': {
            'LoreftIntervention.load_state_dict': '797643a93e01499d',
            'LoreftIntervention.state_dict': '07236ec6ab265091',
        },
    },
    'pyreft.reft_model': {
        'a9a5155849072930': {
            'ReftModel.print_trainable_parameters': '314db834fd8f252a',
            'count_parameters': '549d19d8c59a6798',
        },
    },
    'pyreft.reft_trainer': {
        '5c621b5498b0186a': {
            'ReftTrainer._load_best_model': 'fc4eb385db1cc379',
            'ReftTrainer.compute_loss': 'eeebbc91829a7972',
            'ReftTrainer.save_model': 'd474bae7d6bf39cc',
            'ReftTrainerForCausalLM.get_train_dataloader': '5d116c2d76a8b831',
            'ReftTrainerForCausalLMDistributed.get_train_dataloader': 'e295c425aee95caf',
            'ReftTrainerForCausalLMDistributed.save_model': '0b6d3f310fbfca11',
            'ReftTrainerForSequenceClassification.compute_loss': 'a98b85688fdb4aa6',
            'ReftTrainerForSequenceClassification.evaluate': 'a59f16e74668a8d4',
        },
        'fc3c0b86ad7fb1a8': {
            'ReftTrainer._load_best_model': '83eefb4304d78792',
            'ReftTrainer.compute_loss': 'ae4794cd68435e1e',
            'ReftTrainer.save_model': '983e15605f290488',
            'ReftTrainerForCausalLM.get_train_dataloader': '5d116c2d76a8b831',
            'ReftTrainerForCausalLMDistributed.get_train_dataloader': 'e295c425aee95caf',
            'ReftTrainerForCausalLMDistributed.save_model': '0b6d3f310fbfca11',
            'ReftTrainerForSequenceClassification.compute_loss': 'a98b85688fdb4aa6',
            'ReftTrainerForSequenceClassification.evaluate': 'a59f16e74668a8d4',
        },
    },
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
    'torch.distributed.fsdp._fully_shard._fully_shard': {
        '4536abc84dc343d8': {
            'fully_shard': '9a3296bbf4f8f895',
        },
        'bd51118b2efcb3b6': {
            'fully_shard': '52398820d16a2361',
        },
        'fcff8a351d6bc403': {
            'fully_shard': 'f18b191885f51a62',
        },
    },
    'torch.distributed.fsdp.fully_sharded_data_parallel': {
        '1533c88f7549ced1': {
            'FullyShardedDataParallel.__init__': '9fbb399e395565a8',
        },
        '8feb0c1781ea264b': {
            'FullyShardedDataParallel.__init__': '9fbb399e395565a8',
        },
    },
    'torch.nn.functional': {
        '990a8b717645fa60': {
            'dropout': 'de4ee9f332ff8254',
        },
        '06f330c5ce12f7a7': {
            'dropout': 'de4ee9f332ff8254',
        },
        '5a3bacfc98d3a3b7': {
            'dropout': 'de4ee9f332ff8254',
        },
    },
    'torch.nn.modules.dropout': {
        '2ac0b163bbdfa5c6': {
            'Dropout.forward': '00f268cdc994d862',
        },
        'f1abdbdda095e9ee': {
            'Dropout.forward': '00f268cdc994d862',
        },
    },
    'torch.nn.modules.linear': {
        '1961ad1a1f650e10': {
            'Linear.forward': '76181b0142f43480',
        },
        '45aa464d373ca22c': {
            'Linear.forward': '76181b0142f43480',
        },
    },
    'torch.nn.modules.module': {
        '341153e4099444f9': {
            'Module._call_impl': 'b3e906e8894df01a',
        },
        '0758af0e6a4214bc': {
            'Module._call_impl': 'b3e906e8894df01a',
        },
        '6e1d498b3b199772': {
            'Module._call_impl': 'b2dda8540637847d',
        },
    },
    'torch.nn.parallel.data_parallel': {
        '7420bb5408a5169e': {
            'DataParallel.replicate': '24085ea5d58aa1fd',
            'DataParallel.scatter': 'b9e3e06ec85907e8',
        },
        '39df30aad28010c4': {
            'DataParallel.replicate': '24085ea5d58aa1fd',
            'DataParallel.scatter': 'b9e3e06ec85907e8',
        },
    },
    'torch.nn.parallel.distributed': {
        '6b51551836096981': {
            'DistributedDataParallel.__init__': 'c3b695e1e6bf23f3',
        },
        'cb4a5fbb455e9915': {
            'DistributedDataParallel.__init__': 'b24e2b1453cbc8be',
        },
        'ff36d22a7d8d7671': {
            'DistributedDataParallel.__init__': 'bcfa8765fb8cba7c',
        },
    },
    'torch.nn.parallel.replicate': {
        '2e2ab2f3f76ec066': {
            'replicate': '83ae0960fdb0d08d',
        },
        '7ac83114647aecd8': {
            'replicate': '1a142bee24785c03',
        },
    },
    'torch.nn.utils.parametrizations': {
        '99b9f356341c4e29': {
            '_Orthogonal.forward': '5bfb105bed649a2b',
        },
        '0d287d1854745a61': {
            '_Orthogonal.forward': '5bfb105bed649a2b',
        },
    },
    'transformers.activations': {
        '5b20c0a3625edc00': {
            'LinearActivation.forward': 'e9cadc4c0a27bfd2',
        },
    },
    'transformers.trainer': {
        '87e1c73bc1263027': {
            'Trainer._load_from_checkpoint': '1fa7425d1ea7cc18',
            'Trainer._set_signature_columns_if_needed': 'e10ded1c3e2e5f24',
            'Trainer.compute_loss': '30eb16e597ada0b9',
            'Trainer.create_accelerator_and_postprocess': '8ce6b18b6c682c6e',
            'Trainer.evaluate': 'ce448ad06606289f',
            'Trainer.get_decay_parameter_names': '5b5b4ea618c87dd8',
            'Trainer.train': '0bc847a1e101c362',
        },
        '1bb62572e150a929': {
            'Trainer._load_from_checkpoint': '39f4f0890ea22740',
            'Trainer._set_signature_columns_if_needed': 'e10ded1c3e2e5f24',
            'Trainer.compute_loss': '1d58d1479f8f5989',
            'Trainer.create_accelerator_and_postprocess': '59675ab578b3239c',
            'Trainer.evaluate': 'ce448ad06606289f',
            'Trainer.get_decay_parameter_names': '5b5b4ea618c87dd8',
            'Trainer.train': 'e8a272bcd2dbc9ef',
        },
        '44ce713470a301ec': {
            'Trainer._load_from_checkpoint': '1fa7425d1ea7cc18',
            'Trainer._set_signature_columns_if_needed': 'e10ded1c3e2e5f24',
            'Trainer.compute_loss': '30eb16e597ada0b9',
            'Trainer.create_accelerator_and_postprocess': '8ce6b18b6c682c6e',
            'Trainer.evaluate': 'ce448ad06606289f',
            'Trainer.get_decay_parameter_names': '5b5b4ea618c87dd8',
            'Trainer.train': '0bc847a1e101c362',
        },
    },
}
