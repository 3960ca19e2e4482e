use std::fmt::Display;

// kiln: the synthetic stand-in for burn's `vision::MnistItem` (nothing is downloaded here).
use crate::synthetic::MnistItem;
use burn::{
    backend::Flex,
    data::{dataloader::batcher::Batcher, dataset::transform::Mapper},
    prelude::*,
    tensor::ops::IntElem,
};

#[derive(Clone, Debug, Default)]
pub struct MnistBatcher {}

#[derive(Clone, Debug)]
pub struct MnistBatch<B: Backend> {
    pub images: Tensor<B, 3>,
    pub targets: Tensor<B, 1, Int>,
}

impl<B: Backend> Batcher<B, MnistItemPrepared, MnistBatch<B>> for MnistBatcher {
    fn batch(&self, items: Vec<MnistItemPrepared>, device: &B::Device) -> MnistBatch<B> {
        let images = items.iter().map(|item| item.image.clone()).collect();

        let targets = items
            .iter()
            .map(|item| {
                Tensor::<Flex, 1, Int>::from_data(
                    TensorData::from([(item.label as i64).elem::<IntElem<Flex>>()]),
                    &Default::default(),
                )
            })
            .collect();

        let images = Tensor::cat(images, 0);
        let images = Tensor::from_data(images.into_data(), device);

        let targets = Tensor::cat(targets, 0);
        let targets = Tensor::from_data(targets.into_data(), device);

        MnistBatch { images, targets }
    }
}

// kiln: how a batch splits among data-parallel ranks (each takes its rows).
impl<B: Backend> kiln::learner::Split for MnistBatch<B> {
    fn rows(&self) -> usize {
        self.targets.dims()[0]
    }
    fn split(&self, share: &kiln::learner::Share) -> Self {
        MnistBatch {
            images: share.rows_of(&self.images),
            targets: share.rows_of(&self.targets),
        }
    }
}

#[derive(Clone, Debug, Copy)]
pub enum Transform {
    Translate,
    Shear,
    Scale,
    Rotation,
}

impl Display for Transform {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Transform::Translate => f.write_str("Tr"),
            Transform::Shear => f.write_str("Sr"),
            Transform::Scale => f.write_str("Sc"),
            Transform::Rotation => f.write_str("Rot"),
        }
    }
}

#[derive(Default)]
pub struct MnistMapper {
    transforms: Vec<Transform>,
}

impl MnistMapper {
    pub fn transform(mut self, transforms: &[Transform]) -> Self {
        for t in transforms {
            self.transforms.push(*t);
        }
        self
    }
    pub fn translate(mut self) -> Self {
        self.transforms.push(Transform::Translate);
        self
    }
    pub fn shear(mut self) -> Self {
        self.transforms.push(Transform::Shear);
        self
    }
    pub fn scale(mut self) -> Self {
        self.transforms.push(Transform::Scale);
        self
    }
    pub fn rotation(mut self) -> Self {
        self.transforms.push(Transform::Rotation);
        self
    }
}

impl Mapper<MnistItem, MnistItemPrepared> for MnistMapper {
    fn map(&self, item: &MnistItem) -> MnistItemPrepared {
        prepare_image(&self.transforms, item.clone())
    }
}

#[derive(Clone, Debug)]
pub struct MnistItemPrepared {
    image: Tensor<Flex, 3>,
    label: u8,
}

fn prepare_image(transforms: &[Transform], item: MnistItem) -> MnistItemPrepared {
    let data = TensorData::from(item.image);
    let tensor = Tensor::<Flex, 2>::from_data(data.convert::<f32>(), &Default::default());
    let tensor = tensor.reshape([1, 28, 28]);

    // normalize: make between [0,1] and make the mean =  0 and std = 1
    // values mean=0.1307,std=0.3081 were copied from Pytorch Mist Example
    // https://github.com/pytorch/examples/blob/54f4572509891883a947411fd7239237dd2a39c3/mnist/main.py#L122
    let tensor = ((tensor / 255) - 0.1307) / 0.3081;
    // kiln: burn's random augmentations (`burn::vision::Transform2D`, drawn from `rand::rng()`,
    // so no two runs alike) are not built here; the runs use the plain images only.
    assert!(
        transforms.is_empty(),
        "augmentations are not built in this port (burn's `vision` feature)"
    );

    MnistItemPrepared {
        image: tensor,
        label: item.label,
    }
}
