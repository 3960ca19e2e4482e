// The AgNewsDataset and DbPediaDataset structs are examples of specific text
// classification datasets.  Each dataset struct has a field for the underlying
// SQLite dataset and implements methods for accessing and processing the data.
// Each dataset is also provided with specific information about its classes via
// the TextClassificationDataset trait. These implementations are designed to be used
// with a machine learning framework for tasks such as training a text classification model.

use burn::data::dataset::{Dataset, InMemDataset};

// Define a struct for text classification items
#[derive(new, Clone, Debug)]
pub struct TextClassificationItem {
    pub text: String, // The text for classification
    pub label: usize, // The label of the text (classification category)
}

// Trait for text classification datasets
pub trait TextClassificationDataset: Dataset<TextClassificationItem> {
    fn num_classes() -> usize; // Returns the number of unique classes in the dataset
    fn class_name(label: usize) -> String; // Returns the name of the class given its label
}

// Struct for items in the AG News dataset
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct AgNewsItem {
    pub text: String, // The text for classification
    pub label: usize, // The label of the text (classification category)
}

// Struct for the AG News dataset
pub struct AgNewsDataset {
    // kiln: synthetic headlines in memory (upstream: the Hugging Face download, in SQLite).
    dataset: InMemDataset<AgNewsItem>,
}

// Implement the Dataset trait for the AG News dataset
impl Dataset<TextClassificationItem> for AgNewsDataset {
    /// Returns a specific item from the dataset
    fn get(&self, index: usize) -> Option<TextClassificationItem> {
        self.dataset
            .get(index)
            .map(|item| TextClassificationItem::new(item.text, item.label)) // Map AgNewsItems to TextClassificationItems
    }

    /// Returns the length of the dataset
    fn len(&self) -> usize {
        self.dataset.len()
    }
}

// Implement methods for constructing the AG News dataset
impl AgNewsDataset {
    /// Returns the training portion of the dataset
    pub fn train() -> Self {
        Self::new("train")
    }

    /// Returns the testing portion of the dataset
    pub fn test() -> Self {
        Self::new("test")
    }

    /// Constructs the dataset from a split (either "train" or "test")
    pub fn new(split: &str) -> Self {
        // kiln: 2,000 synthetic headlines per split, made from the split's name.
        let salt = split
            .bytes()
            .fold(7u64, |h, b| h.wrapping_mul(31).wrapping_add(b as u64));
        let dataset = InMemDataset::new((0..2_000).map(|i| synthetic(salt, i)).collect());
        Self { dataset }
    }
}

/// A headline of a class's words and common words, from `(salt, index)` alone.
fn synthetic(salt: u64, index: u64) -> AgNewsItem {
    const CLASS: [&[&str]; 4] = [
        &[
            "election",
            "minister",
            "treaty",
            "border",
            "summit",
            "parliament",
        ],
        &["match", "season", "coach", "goal", "league", "champion"],
        &["market", "shares", "profit", "bank", "merger", "prices"],
        &[
            "software", "chip", "internet", "launch", "device", "network",
        ],
    ];
    const COMMON: [&str; 8] = ["the", "a", "on", "after", "new", "says", "in", "report"];
    let mut x = salt ^ index.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let label = (next() % 4) as usize;
    let words = 4 + (next() % 8) as usize;
    let text = (0..words)
        .map(|_| match next() % 3 {
            0 => COMMON[(next() % 8) as usize],
            _ => CLASS[label][(next() % 6) as usize],
        })
        .collect::<Vec<_>>()
        .join(" ");
    AgNewsItem { text, label }
}

/// Implements the TextClassificationDataset trait for the AG News dataset
impl TextClassificationDataset for AgNewsDataset {
    /// Returns the number of unique classes in the dataset
    fn num_classes() -> usize {
        4
    }

    /// Returns the name of a class given its label
    fn class_name(label: usize) -> String {
        match label {
            0 => "World",
            1 => "Sports",
            2 => "Business",
            3 => "Technology",
            _ => panic!("invalid class"),
        }
        .to_string()
    }
}

// kiln: upstream's DbPedia dataset (another download) is left out.
