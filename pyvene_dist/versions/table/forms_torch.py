"""The forms of the torch functions pyvene_dist's fixes depend on (``versions.forms``). Generated: after a
run passes on other releases, ``python -m pyvene_dist.fix_list --record`` adds their forms (``--source DIR
--release NAME=RELEASE`` a source tree's). Edit by re-recording, not by hand."""

from typing import Final

#: Target -> {source fingerprint: the releases it was seen and tested with}.
KNOWN: Final = {
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
}

#: Module -> {digest of a file recorded: {function: its fingerprint there}}: a file as recorded is not read.
FILES: Final = {
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
}
