// This module trains a text classification model using the provided training and testing datasets,
// as well as the provided configuration. It first initializes a tokenizer and batchers for the datasets,
// then initializes the model and data loaders for the datasets. The function then initializes
// an optimizer and a learning rate scheduler, and uses them along with the model and datasets
// to build a learner, which is used to train the model. The trained model and the configuration are
// then saved to the specified directory.

use crate::{
    data::{TextClassificationBatcher, TextClassificationDataset, Tokenizer, WordTokenizer},
    model::{TextClassificationModel, TextClassificationModelConfig},
};

use burn::train::{Learner, LearningComponentsMarker, SupervisedTraining, TrainingStrategy};
use burn::{
    data::{
        dataloader::DataLoaderBuilder,
        dataset::transform::{SamplerDataset, SamplerDatasetOptions},
    },
    lr_scheduler::noam::{NoamLrScheduler, NoamLrSchedulerConfig},
    nn::{attention::SeqLengthOption, transformer::TransformerEncoderConfig},
    optim::AdamConfig,
    optim::{Adam, adaptor::OptimizerAdaptor},
    prelude::*,
    record::{CompactRecorder, FullPrecisionSettings, NamedMpkFileRecorder, Recorder},
    tensor::backend::AutodiffBackend,
    train::metric::{AccuracyMetric, IterationSpeedMetric, LearningRateMetric, LossMetric},
};
use std::sync::Arc;

// Define configuration struct for the experiment
#[derive(Config, Debug)]
pub struct ExperimentConfig {
    pub transformer: TransformerEncoderConfig,
    pub optimizer: AdamConfig,
    #[config(default = "SeqLengthOption::Fixed(256)")]
    pub seq_length: SeqLengthOption,
    #[config(default = 8)]
    pub batch_size: usize,
    #[config(default = 5)]
    pub num_epochs: usize,
    // kiln: the sampled sizes and the sampler's seed (upstream: 50,000 and 5,000 items drawn
    // from the system's generator, so no two runs, or processes, alike).
    #[config(default = 50_000)]
    pub train_items: usize,
    #[config(default = 5_000)]
    pub test_items: usize,
    #[config(default = 42)]
    pub seed: u64,
    // kiln: resume from this epoch's checkpoint (`SupervisedTraining::checkpoint`), and write
    // checkpoints in full precision (upstream: CompactRecorder, half precision).
    pub resume: Option<usize>,
    #[config(default = false)]
    pub full_precision_checkpoints: bool,
}

/// The Learner's components (kiln: named, so that `train` takes the training strategy).
pub type Components<B> = LearningComponentsMarker<
    B,
    NoamLrScheduler,
    TextClassificationModel<B>,
    OptimizerAdaptor<Adam, TextClassificationModel<B>, B>,
>;

fn create_artifact_dir(artifact_dir: &str) {
    // Remove existing artifacts before to get an accurate learner summary
    std::fs::remove_dir_all(artifact_dir).ok();
    std::fs::create_dir_all(artifact_dir).ok();
}

// Define train function
pub fn train<B: AutodiffBackend, D: TextClassificationDataset + 'static>(
    strategy: TrainingStrategy<Components<B>>,
    dataset_train: D,         // Training dataset
    dataset_test: D,          // Testing dataset
    config: ExperimentConfig, // Experiment configuration
    artifact_dir: &str,       // Directory to save model and config files
) -> TextClassificationModel<B::InnerBackend> {
    // kiln: a resumed run keeps the directory (its checkpoints); upstream always empties it.
    match config.resume {
        None => create_artifact_dir(artifact_dir),
        Some(_) => std::fs::create_dir_all(artifact_dir).unwrap(),
    }

    // Initialize tokenizer
    let tokenizer = Arc::new(WordTokenizer);

    // Initialize batcher
    let batcher = TextClassificationBatcher::new(tokenizer.clone(), config.seq_length);

    // Initialize model
    let model = TextClassificationModelConfig::new(
        config.transformer.clone(),
        D::num_classes(),
        tokenizer.vocab_size(),
        config.seq_length,
    )
    .init::<B>(&Default::default());

    // Initialize data loaders for training and testing data
    let dataloader_train = DataLoaderBuilder::new(batcher.clone())
        .batch_size(config.batch_size)
        .num_workers(1)
        .build(SamplerDataset::new(
            dataset_train,
            SamplerDatasetOptions::from(config.train_items).with_seed(config.seed),
        ));
    let dataloader_test = DataLoaderBuilder::new(batcher)
        .batch_size(config.batch_size)
        .num_workers(1)
        .build(SamplerDataset::new(
            dataset_test,
            SamplerDatasetOptions::from(config.test_items).with_seed(config.seed + 1),
        ));

    // Initialize optimizer
    let optim = config.optimizer.init();

    // Initialize learning rate scheduler
    let lr_scheduler = NoamLrSchedulerConfig::new(1e-2)
        .with_warmup_steps(1000)
        .with_model_size(config.transformer.d_model)
        .init()
        .unwrap();

    // Initialize learner
    let training = SupervisedTraining::new(artifact_dir, dataloader_train, dataloader_test)
        // kiln: no CudaMetric (burn's `metrics` feature, NVML)
        .metric_train(IterationSpeedMetric::new())
        .metric_train_numeric(LossMetric::new())
        .metric_valid_numeric(LossMetric::new())
        .metric_train_numeric(AccuracyMetric::new())
        .metric_valid_numeric(AccuracyMetric::new())
        .metric_train_numeric(LearningRateMetric::new())
        .with_training_strategy(strategy)
        .num_epochs(config.num_epochs)
        .summary();

    let training = if config.full_precision_checkpoints {
        training.with_file_checkpointer(NamedMpkFileRecorder::<FullPrecisionSettings>::new())
    } else {
        training.with_file_checkpointer(CompactRecorder::new())
    };
    let training = match config.resume {
        Some(epoch) => training.checkpoint(epoch),
        None => training,
    };

    // Train the model
    let result = training.launch(Learner::new(model, optim, lr_scheduler));

    // Save the configuration and the trained model
    config.save(format!("{artifact_dir}/config.json")).unwrap();
    CompactRecorder::new()
        .record(
            result.model.clone().into_record(),
            format!("{artifact_dir}/model").into(),
        )
        .unwrap();
    result.model
}
