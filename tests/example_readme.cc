// The README's usage example, compiled and run (at 2 ranks) so the README stays true.

#include <gradcomm/gradcomm.h>

#include <cstdio>
#include <vector>

int main(int argc, char** argv) {
  gradcomm::init(&argc, &argv);  // MPI_Init unless MPI is already initialized
  int failures = 0;
  {
    gradcomm::Communicator comm(MPI_COMM_WORLD);  // duplicates the communicator; reads GRADCOMM_*
    std::vector<float> grads(1 << 20, 1.0f);

    // In place, averaged over ranks, algorithm from GRADCOMM_ALGORITHM (default: auto).
    gradcomm::allreduce(comm, grads.data(), grads.data(), grads.size(), gradcomm::DataType::float32,
                        gradcomm::ReduceOp::avg);

    // Out of place, typed, with an explicit algorithm.
    std::vector<float> sum(grads.size());
    gradcomm::allreduce<float>(comm, grads, sum, gradcomm::ReduceOp::sum, {.algorithm = "ring"});

    failures += grads[12345] != 1.0f;
    failures += sum[12345] != static_cast<float>(comm.size());

    // The trainer example (README, "Training").
    using namespace gradcomm::trainer;
    Dataset data = Dataset::synthetic({.samples = 16384, .features = 32, .classes = 10});
    auto model = make_mlp(32, {128, 128}, 10);
    Optimizer optimizer({.kind = OptimizerKind::adam}, model->parameters());
    DataParallelTrainer trainer(comm, *model, optimizer,
                                {.global_batch = 240, .lr = {.lr = 1e-3, .warmup_steps = 20}});
    for (int i = 0; i < 500; ++i) {
      StepStats st = trainer.step(data);
      (void)st;
    }
    Evaluation e = trainer.evaluate(data);
    std::vector<float> p = trainer.predict(data.rows(0, 100));
    failures += e.accuracy < 0.9;
    failures += p.size() != 100;
    if (comm.rank() == 0)
      std::printf("%d passed, %d failed (accuracy %.3f)\n", 4 - failures, failures, e.accuracy);
  }                      // free communicators before finalize
  gradcomm::finalize();  // finalizes MPI only if init() started it
  return failures == 0 ? 0 : 1;
}
