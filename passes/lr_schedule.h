// Learning-rate schedules (`kiln.train.lr_schedule`), evaluated on the host by the trainer each
// step and fed to @train_step through its `lr` input as a factor of the optimizers' base rates.
//
//   {kind = "constant"}                                     1
//   {kind = "warmup_decay", warmup_steps = W, decay_start = S, decay_steps = D,
//    end_factor = E, power = P}                             step / W          for step <= W
//                                                           1                 for W < step <= S
//                                                           E + (1-E) * (1 - min(step-S, D)/D)^P
//                                                                             for step > S
//     (MLPerf DLRM's linear warmup and polynomial decay; P defaults to 1, linear; D = 0 means
//      no decay)
//   {kind = "exponential", decay_rate = R, decay_steps = D, staircase = false,
//    warmup_steps = W}                                      linear warmup as above, then
//                                                           R ^ ((step - W - 1) / D), the exponent
//                                                           floored when staircase
// `step` is 1-based, like @train_step's `step` input.
#pragma once

#include <cstdint>

#include "ir/attribute.h"
#include "ir/status.h"

namespace kiln::passes {

// Checks a schedule's kind and fields (names the offending field); the autodiff pass calls it so
// that a bad schedule fails at compile time, not in the training loop.
Status checkLrSchedule(const ir::AttrDict& schedule);

// The factor for `step` of a schedule that passed checkLrSchedule (an empty dict is constant).
double learningRateFactor(const ir::AttrDict& schedule, int64_t step);

}  // namespace kiln::passes
