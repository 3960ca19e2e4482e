#[global_allocator]
static ALLOC: kiln_shard::account::RankAlloc = kiln_shard::account::RankAlloc;

#[test]
fn default_recipe_on_shapes() {
    let recipe = kiln_train::Recipe::load(
        None,
        &[
            "parallel.ranks=2".into(),
            "parallel.strategy=\"zero3\"".into(),
        ],
    )
    .unwrap();
    let s = kiln_plan::simulate(&recipe, 8, "local").unwrap();
    println!("elapsed {:?}", s.elapsed);
    for r in &s.roles {
        println!("rank {} stage {} memory {:?}", r.rank, r.stage, r.memory);
        for e in &r.events {
            println!("  {:?}", e);
        }
    }
}
