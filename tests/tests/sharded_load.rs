//! Loading a Hugging Face checkpoint into a ZeRO-3 model shards each tensor as it is read: no
//! rank holds the whole model, the values are the file's, and the loaded parameters' gradients
//! are reduced by the hook (the load replaced them, `refresh` marked them again).

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Int, Tensor};
use kiln::{Flex, Train};
use kiln_comm::{LocalGroup, ProcessGroup, spawn_ranks};
use kiln_hf::verify::Parallel;
use kiln_hf::{Pretrained, SafetensorsFile};
use kiln_llama::{Llama, LlamaConfig};
use kiln_model::causal_lm_loss;
use kiln_shard::{ShardTensor, Strategy};
use kiln_zoo::parallel::Sharding;
use std::path::PathBuf;
use std::sync::Arc;

type B = Train<Flex>;

fn dir() -> PathBuf {
    kiln_tests::fixture("tiny-llama")
}

/// (elements held locally, elements of the whole parameters, every parameter sharded)
struct Held(usize, usize, bool);

impl ModuleVisitor<B> for Held {
    fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
        let prim = p.val().inner().into_primitive().tensor();
        self.1 += burn::tensor::TensorMetadata::shape(&prim).num_elements();
        match &prim {
            ShardTensor::Sharded(s) => {
                self.0 += burn::tensor::TensorMetadata::shape(&s.shard).num_elements();
            }
            _ => self.2 = false,
        }
    }
}

#[test]
fn zero3_loads_a_checkpoint_shard_by_shard() {
    let device = Default::default();
    let whole: Llama<B> = Llama::from_pretrained(dir(), &device).unwrap();
    let expected = kiln_shard::check::params::<Flex, _>(&whole);
    let results = spawn_ranks(4, |g: LocalGroup| {
        let group: Arc<dyn ProcessGroup> = Arc::new(g);
        let parallel = Sharding::<Flex>::new(group, Strategy::Zero3).unwrap();
        let skeleton = LlamaConfig::from_dir(dir()).unwrap().init::<B>(&device);
        let model = parallel.prepare(skeleton).unwrap();
        let model = model
            .load_safetensors(dir().join("model.safetensors"))
            .unwrap();
        parallel.refresh(&model);

        let mut held = Held(0, 0, true);
        model.visit(&mut held);
        assert!(held.2, "a loaded parameter is whole");

        // A backward reduce-scatters the loaded parameters' gradients.
        let file = SafetensorsFile::open(dir().join("reference.safetensors"), "reference").unwrap();
        let ids = Tensor::<B, 2, Int>::from_data(file.int("input_ids").unwrap(), &device);
        let labels = Tensor::<B, 2, Int>::from_data(file.int("labels").unwrap(), &device);
        let loss = causal_lm_loss(model.forward(ids), labels);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let g: Tensor<kiln::Kiln<Flex>, 2> = grads.get(model.model.embed_tokens.weight.id).unwrap();
        assert!(
            g.into_primitive().tensor().is_sharded(),
            "the gradient was not reduce-scattered"
        );

        (held.0, held.1, kiln_shard::check::params::<Flex, _>(&model))
    });
    let total = results[0].1;
    let local: usize = results.iter().map(|r| r.0).sum();
    assert_eq!(local, total, "the shards tile the model");
    for (rank, r) in results.iter().enumerate() {
        assert!(
            r.0 <= total / 4 + 64,
            "rank {rank} holds {} of {total} elements",
            r.0
        );
        assert_eq!(
            r.2, expected,
            "rank {rank}: loaded values differ from the file's"
        );
    }
}
