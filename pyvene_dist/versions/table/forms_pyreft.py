"""The forms of the pyreft functions pyvene_dist's fixes depend on (``versions.forms``). Generated: after a
run passes on other releases, ``python -m pyvene_dist.fix_list --record`` adds their forms (``--source DIR
--release NAME=RELEASE`` a source tree's). Edit by re-recording, not by hand."""

from typing import Final

#: Target -> {source fingerprint: the releases it was seen and tested with}.
KNOWN: Final = {
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
}

#: Module -> {digest of a file recorded: {function: its fingerprint there}}: a file as recorded is not read.
FILES: Final = {
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
}
